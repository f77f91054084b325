"""Namespaces and the filesystem view of a sandboxed execution (used by ``_sandbox_child.py``).

Inside new pid, net, mount and ipc namespaces (plus a user namespace when not root) the
supervisor builds what the code sees: a fresh ``/proc`` whose kernel knobs (``/proc/sys``,
``/proc/sysrq-trigger``, ...) are read-only, every host mount read-only (``/sys`` included), a
minimal read-only ``/dev`` (null, zero, full, random, urandom, a private ``shm``), secrets in
``/etc`` (shadow files, sudoers) replaced by empty files, a private tmpfs ``/tmp`` holding the
working directory, and masked directories (home directories, ``hide_paths``, and any directory
an unprivileged uid could not cross on the way to the Python installation) replaced by empty
tmpfs; a hidden file (``hide_paths``, the run's data) reads as empty. Each hidden path the view
covers is reported as the layer ``hidden:PATH``. The Python installation and its site-packages
stay visible, read-only, wherever they live, even inside ``/tmp`` or a masked directory.
Standard library only, cheap imports only.
"""

import os

from _sandbox_code import check, libc, mount

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
TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # all the same private tmpfs inside
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


def under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


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


def closed_ancestors(path, uid):
    """The directories on the way to ``path`` that ``uid`` cannot cross (to mask)."""
    out = []
    parts = path.rstrip("/").split("/")
    for i in range(2, len(parts)):
        d = "/".join(parts[:i])
        try:
            st = os.stat(d)
        except OSError:
            continue
        if not (st.st_mode & 0o001 or (st.st_uid == uid and st.st_mode & 0o100)):
            out.append(d)
    return out


def readonly(point):
    flags = dict(mountinfo()).get(point, 0)
    mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)


def bind_fd(fd, target, recursive=True):
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | (MS_REC if recursive else 0))


def set_up_mounts(req, layers, notes, uid):
    """Build the code's view of the filesystem (see the module docstring); returns the workdir."""
    keep = [p for p in req["python_paths"] if os.path.isdir(p)]
    masked = {m for m in req["mask"] if os.path.isdir(m) and m != "/"}
    files = sorted(m for m in req.get("hide", ()) if os.path.isfile(m) and not os.path.islink(m))
    if uid is not None:  # directories the unprivileged uid could not cross on the way to Python
        for p in keep:
            masked.update(closed_ancestors(p, uid))
    masked = sorted(m for m in masked if not any(under(m, k) for k in keep) and not any(under(m, t) for t in TMP_DIRS))
    masked = [m for m in masked if not any(m != o and under(m, o) for o in masked)]  # outermost only
    # a masked directory, or the private /tmp, hides them already
    files = [f for f in files if not any(under(f, m) for m in (*masked, *TMP_DIRS))]
    hidden = [*masked, *TMP_DIRS]
    reexpose = [p for p in keep if any(under(p, h) for h in hidden)]
    fds = {p: os.open(p, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for p in reexpose}
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
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={req['disk_mb']}m,nr_inodes=16384,mode=1777")
        new_dev = set_up_dev(devs, layers, notes)
        for extra in TMP_DIRS[1:]:
            if os.path.isdir(extra) and not os.path.islink(extra):
                try:
                    mount("/tmp", extra, None, MS_BIND)
                except OSError as exc:
                    notes.append(f"could not hide {extra} ({exc})")
        for m in masked:
            mount("tmpfs", m, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        for p in reexpose:  # the Python installation, wherever it was hidden: read-only
            os.makedirs(p, 0o755, exist_ok=True)
            bind_fd(fds[p], p)
            readonly(p)
        for m in masked:
            readonly(m)
        if masked:
            layers.append("masked_dirs")
        mask_etc(layers, notes)
        covered = [*masked, *TMP_DIRS]
        for f in files:  # a hidden file reads as empty, like the secrets of /etc
            try:
                mount("/dev/null", f, None, MS_BIND)
                readonly(f)
                covered.append(f)
            except OSError as exc:
                notes.append(f"could not hide {f} ({exc})")
        layers.extend("hidden:" + path for path in req.get("hide", ()) if any(under(path, c) for c in covered))
        if new_dev:
            readonly("/dev")
    finally:
        for fd in (*fds.values(), *devs.values()):
            os.close(fd)
    os.mkdir(WORKDIR_IN_NAMESPACE, 0o700)
    return WORKDIR_IN_NAMESPACE


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


def python_layout(sys):
    """This interpreter's installation (to keep visible) and its site-packages (to import from).

    Run with ``-S``, a venv's interpreter still has the base installation's ``sys.prefix``: its
    own prefix is the directory of the ``pyvenv.cfg`` next to (or above) the executable.
    """
    import site

    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    site_prefixes = [sys.prefix]
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    for venv in (exe_dir, os.path.dirname(exe_dir)):
        if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
            prefixes.append(venv)
            with open(os.path.join(venv, "pyvenv.cfg")) as f:
                system = any(line.replace(" ", "").lower().startswith("include-system-site-packages=true") for line in f)
            site_prefixes = [venv, sys.base_prefix] if system else [venv]
            break
    site_dirs = [d for d in site.getsitepackages(site_prefixes) if os.path.isdir(d)]
    paths = sorted({os.path.realpath(p) for p in (*prefixes, *site_dirs, *linked_elsewhere(site_dirs))})
    paths = [p for p in paths if not any(p != q and under(p, q) for q in paths)]
    return {"python_paths": paths, "site_dirs": site_dirs}


def linked_elsewhere(site_dirs):
    """What site-packages reach outside themselves: the targets of symlinked entries (a package
    linked from another environment) and the directories named in ``.pth`` files (editable
    installs), so they stay visible when they live under a masked directory such as /tmp."""
    found = []
    for directory in site_dirs:
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        for name in entries:
            path = os.path.join(directory, name)
            if os.path.islink(path) and os.path.exists(path):
                found.append(path)
            elif name.endswith(".pth"):
                try:
                    with open(path) as f:
                        lines = [line.strip() for line in f]
                except OSError:
                    continue
                found += [line for line in lines if line.startswith("/") and os.path.isdir(line)]
    return found
