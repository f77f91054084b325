"""Namespaces and the filesystem view of a sandboxed execution (used by ``_sandbox_child.py``).

Inside new pid, net, mount and ipc namespaces (plus a user namespace when not root) the
supervisor builds what the code sees: a fresh ``/proc`` whose kernel knobs (``/proc/sys``,
``/proc/sysrq-trigger``, ...) are read-only, every host mount read-only (``/sys`` included), a
minimal read-only ``/dev`` (null, zero, full, random, urandom, a private ``shm``), secrets in
``/etc`` (shadow files, sudoers) replaced by empty files, a private tmpfs ``/tmp`` holding the
working directory, and the plan of ``_sandbox_view.py``: masked directories (home directories
and any directory an unprivileged uid could not cross on the way to the Python installation)
replaced by empty tmpfs, editable installs showing only their importable entries (their project
folders emptied around them), and hidden paths (``hide_paths``, the run's data, and the project
of an editable install whose import hook is not understood) that do not exist inside, their
names in no mount. Each hidden path is then checked from inside (`is_gone`: no read can return
the host's content) and only then reported as the layer ``hidden:PATH`` (and, for such a
project, ``editable_hook_not_understood:PATH``). The Python installation and its site-packages
stay visible, read-only, wherever they live, even inside ``/tmp`` or a masked directory.
Standard library only, cheap imports only.
"""

import os

from _sandbox_code import check, libc, mount
from _sandbox_view import plan, under

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
O_PATH = getattr(os, "O_PATH", 0o10000000)
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
WORKDIR_IN_NAMESPACE = "/tmp/sandbox"
MAX_PRUNED_ENTRIES = 512  # a hidden path's folder is rebuilt (one mount per entry) up to this size
DEVICES = ("null", "zero", "full", "random", "urandom")
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs", "kcore", "kmsg", "timer_list", "acpi", "scsi")
ETC_SECRETS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers",
               "/etc/security/opasswd", "/etc/ssh/ssh_host_rsa_key", "/etc/ssh/ssh_host_ecdsa_key",
               "/etc/ssh/ssh_host_ed25519_key")


def enter_namespaces(req, notes, report):
    """unshare() pid, net, mount and ipc namespaces (with a user namespace when not root)."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
    uid, gid = os.getuid(), os.getgid()
    as_root = os.geteuid() == 0
    try:
        check(libc().unshare(flags if as_root else flags | CLONE_NEWUSER), "unshare")
    except (OSError, AttributeError) as exc:
        notes.append(f"namespaces unavailable ({exc})")
        return None
    if not as_root:
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as exc:  # too late to stay outside: the host retries without namespaces
            report(req["status_fd"], event="error", stage="namespaces", message=f"user namespace: {exc}")
            os._exit(1)
        return ["user_ns", "pid_ns", "net_ns", "mount_ns", "ipc_ns"]
    return ["pid_ns", "net_ns", "mount_ns", "ipc_ns"]


def mountinfo():
    """(mount point, per-mount flags) of every mount in this mount namespace."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            flags = 0
            for opt in fields[5].split(","):
                flags |= MOUNT_FLAGS.get(opt, 0)
            out.append((point, flags))
    return out


def uid_mapped(uid):
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    except OSError:
        return True
    return any(inside <= uid < inside + count for inside, _, count in ranges)


def traversable(path, uid):
    """Could ``uid`` (with gid ``uid`` and no groups) reach ``path``?"""
    parts = path.rstrip("/").split("/")
    for i in range(1, len(parts) + 1):
        d = "/".join(parts[:i]) or "/"
        try:
            st = os.stat(d)
        except OSError:
            return False
        if not (st.st_mode & 0o001 or (st.st_uid == uid and st.st_mode & 0o100)):
            return False
    return True


def readonly(point):
    flags = dict(mountinfo()).get(point, 0)
    mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)


def bind_fd(fd, target, recursive=True):
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | (MS_REC if recursive else 0))


def set_up_mounts(req, layers, notes, uid):
    """Build the code's view of the filesystem (see the module docstring); returns the workdir."""
    opaque = set(req.get("editable_opaque", ()))
    hidden = sorted({*req.get("hide", ()), *opaque})  # an import hook not understood: its project hidden whole
    ops, visible = plan(req["python_paths"], req.get("source_dirs", ()), req["mask"], hidden, uid,
                        req.get("editable_paths", ()), req.get("editable_roots", ()))
    before = {}  # what each hidden path was on the host, to check it is gone from inside
    for h in hidden:
        try:
            before[h] = (os.lstat(h), os.open(h, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC))
        except OSError:
            pass
    devs = {}
    for name in DEVICES:
        try:
            devs[name] = os.open(f"/dev/{name}", O_PATH | os.O_CLOEXEC)
        except OSError:
            pass
    try:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        set_up_proc(layers, notes)
        all_readonly = True
        for point, flags in mountinfo():
            if under(point, "/proc") or under(point, "/dev") or not os.path.isdir(point):
                continue
            try:  # MS_BIND makes this a per-mount change: the host's mount stays writable
                mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
            except OSError as exc:
                all_readonly = False
                notes.append(f"could not make {point} read-only ({exc})")
        if all_readonly:
            layers.append("readonly_fs")
        detach_mounts_under(hidden, visible, notes)
        new_dev = set_up_dev(devs, layers, notes)
        masked = False
        for op in ops:
            try:
                masked = run_op(op, req, notes) or masked
            except OSError as exc:  # a hidden path that stays is not listed (checked below); the rest is fatal
                if op[0] not in ("prune", "blank", "tmpbind"):
                    raise
                notes.append(f"could not hide {op[1]} ({exc})")
        if masked:
            layers.append("masked_dirs")
        mask_etc(layers, notes)
        if new_dev:
            readonly("/dev")
        for h in hidden:
            if h in before:
                if is_gone(h, *before[h], visible):
                    layers.append("hidden:" + h)
                    if h in opaque:
                        layers.append("editable_hook_not_understood:" + h)
                else:
                    notes.append(f"could not hide {h}: still readable inside")
    finally:
        for fd in (*devs.values(), *(fd for _, fd in before.values())):
            os.close(fd)
    os.mkdir(WORKDIR_IN_NAMESPACE, 0o700)
    return WORKDIR_IN_NAMESPACE


def detach_mounts_under(hidden, visible, notes):
    """Host mounts at or below a hidden path leave this namespace (deepest first): covered, they
    would still be named in /proc/self/mountinfo. Those on the way to, or inside, a visible path
    stay."""
    points = [p for p, _ in mountinfo() if any(under(p, h) for h in hidden)
              and not any(under(v, p) or under(p, v) for v in visible)]
    for point in sorted(points, key=lambda p: p.count("/"), reverse=True):
        if libc().umount2(point.encode(), MNT_DETACH) != 0:
            notes.append(f"could not detach the mount {point}")


def run_op(op, req, notes):
    """Carry out one operation of `plan`; True when it masked a directory."""
    kind, path, arg = op
    if kind in ("tmp", "tmpbind", "empty"):
        if kind != "tmp" and (not os.path.isdir(path) or os.path.islink(path)):
            return False
        fds = {v: os.open(v, O_PATH | os.O_CLOEXEC) for v in arg}  # before the tmpfs covers them
        try:
            if kind == "tmp":
                mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
                      f"size={req['disk_mb']}m,nr_inodes=16384,mode=1777")
            elif kind == "tmpbind":
                mount("/tmp", path, None, MS_BIND)
            else:
                mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
            for v, fd in fds.items():  # what must stay visible under it: read-only
                os.makedirs(os.path.dirname(v), 0o755, exist_ok=True)
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.makedirs(v, 0o755, exist_ok=True)
                else:
                    os.close(os.open(v, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
                bind_fd(fd, v)
                readonly(v)
        finally:
            for fd in fds.values():
                os.close(fd)
        if kind == "empty":
            readonly(path)
        return kind == "empty"
    if kind == "prune":
        prune(path, set(arg))
    elif kind == "blank":
        blank(path)
    return False


def prune(parent, names):
    """Rebuild ``parent`` as a tmpfs holding its entries but ``names``: they no longer exist.
    A parent of more than `MAX_PRUNED_ENTRIES` entries (a mount each) is left, and each of
    ``names`` blanked instead (`blank`: unreadable, but named by a mount)."""
    st = os.stat(parent)
    old = os.open(parent, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        entries = [e for e in os.listdir(parent) if e not in names]
        if len(entries) > MAX_PRUNED_ENTRIES:
            for name in names:
                blank(os.path.join(parent, name))
            return
        links = {e: os.readlink(os.path.join(parent, e)) for e in entries if os.path.islink(os.path.join(parent, e))}
        dirs = {e for e in entries if e not in links and os.path.isdir(os.path.join(parent, e))}
        options = f"size=1m,nr_inodes={len(entries) + 16},mode={st.st_mode & 0o7777:o}"
        try:
            mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, f"{options},uid={st.st_uid},gid={st.st_gid}")
        except OSError:  # an owner this user namespace does not map
            mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, options)
        for e in entries:
            target = os.path.join(parent, e)
            if e in links:
                os.symlink(links[e], target)
                continue
            if e in dirs:
                os.mkdir(target, 0o755)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
            # through the old directory: its entries, mounts on them included, bound back
            mount(f"/proc/self/fd/{old}/{e}", target, None, MS_BIND | MS_REC)
        readonly(parent)
    finally:
        os.close(old)


def blank(path):
    """A hidden path that keeps its name (right under ``/``, or in a folder too large to rebuild):
    an unreadable empty tmpfs over a directory, an unreadable empty file over a file."""
    if os.path.isdir(path) and not os.path.islink(path):
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=000")
        return
    placeholder = "/tmp/.rlhf-hidden-" + os.urandom(6).hex()
    os.close(os.open(placeholder, os.O_CREAT | os.O_WRONLY | os.O_EXCL | os.O_CLOEXEC, 0o000))
    try:
        mount(placeholder, path, None, MS_BIND)
        readonly(path)
    finally:
        os.unlink(placeholder)


def is_gone(path, st, fd, visible):
    """From inside: can no read of ``path`` return what the host holds there? It does not exist,
    or it is another, unreadable file, or (a directory with something visible below it) none of
    the host's entries but the ways to the visible paths exists."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return True
    if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
        return False
    if not os.path.isdir(path):
        return now.st_mode & 0o444 == 0
    if now.st_mode & 0o555 == 0:
        return True
    ways = {v[len(path) + 1:].split("/", 1)[0] for v in visible if v != path and under(v, path)}
    try:
        entries = os.listdir(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return not any(os.path.lexists(os.path.join(path, e)) for e in entries if e not in ways)


def set_up_proc(layers, notes):
    """A /proc of this pid namespace, its kernel knobs read-only."""
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:
        notes.append(f"no private /proc ({exc})")
        return
    layers.append("proc")
    try:
        for name in PROC_READONLY:
            path = "/proc/" + name
            if os.path.exists(path):
                mount(path, path, None, MS_BIND | MS_REC)
                readonly(path)
        layers.append("proc_sys_ro")
    except OSError as exc:
        notes.append(f"/proc/sys stays writable ({exc})")


def set_up_dev(devs, layers, notes):
    """A tmpfs /dev with only harmless devices (bound from the host's), made read-only later.
    Returns False (the host's /dev, read-only where possible) when the kernel refuses."""
    try:
        mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    except OSError as exc:
        notes.append(f"no minimal /dev ({exc})")
        return False
    try:
        for name, fd in devs.items():
            target = "/dev/" + name
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666))
            bind_fd(fd, target, recursive=False)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2")):
            os.symlink(target, "/dev/" + name)
        os.mkdir("/dev/shm", 0o1777)
    except OSError as exc:  # back to the host's /dev rather than a half-built one
        check(libc().umount2(b"/dev", MNT_DETACH), "umount /dev")
        notes.append(f"no minimal /dev ({exc})")
        return False
    layers.append("minimal_dev")
    return True


def mask_etc(layers, notes):
    """Secrets in /etc become empty files (uid 0 can no longer read them either)."""
    null = "/dev/null"
    try:
        for path in ETC_SECRETS:
            if os.path.isfile(path) and not os.path.islink(path):
                mount(null, path, None, MS_BIND)
                readonly(path)
        layers.append("masked_etc")
    except OSError as exc:
        notes.append(f"could not mask secrets in /etc ({exc})")
