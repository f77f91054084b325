"""Supervisor of one sandboxed execution; the other half of ``rlhf.plugins.envs.sandbox``.

``sandbox.run_code`` runs this file as ``python -I -S _sandbox_child.py`` (never imports it;
the code's own process lives in ``_sandbox_code.py``):
it reads one marshal'd request from stdin, isolates itself as far as the OS allows, forks the
process that runs the code, waits for it, kills whatever the code left behind and reports on
the status pipe. Standard library only, and only cheap modules: the whole point is to start
fast (no json, tempfile, shutil or subprocess here).

Process tree with namespaces::

    supervisor (outside) -> init (pid 1 of a new pid namespace; mounts) -> code (unprivileged)

and without: ``supervisor (child subreaper) -> code``. The code runs in a fork of this
interpreter (no second Python start-up), in a fresh ``__main__``.

Status pipe messages (4-byte big-endian length + marshal'd dict): ``start`` (isolation layers,
notes, workdir), ``exit`` (returncode or signal, CPU seconds), ``error`` (setup failed).
"""

import _signal as signal  # the C module: `signal` would import enum, ~8 ms at every start
import marshal
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sandbox_code import (  # noqa: E402 - the sibling module, found through the line above
    LINUX, PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, check, libc, mount, prctl, report, run,
)

del sys.path[0]

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
WORKDIR_IN_NAMESPACE = "/tmp/sandbox"

_victim = 0  # the process a SIGTERM from the host turns into a SIGKILL for


def on_sigterm(signum, frame):
    if _victim:
        for kill in (os.killpg, os.kill):  # without namespaces the victim leads the code's process group
            try:
                kill(_victim, signal.SIGKILL)
            except OSError:
                pass


# --- namespaces and mounts -------------------------------------------------------------------


def enter_namespaces(req, notes):
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


def set_up_mounts(req, layers, notes):
    """Fresh /proc, read-only view of the host, private tmpfs /tmp, masked home directories."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        layers.append("proc")
    except OSError as exc:
        notes.append(f"no private /proc ({exc})")
    readonly = True
    for point, flags in mountinfo():
        if any(under(point, p) for p in ("/proc", "/sys", "/dev")) or not os.path.isdir(point):
            continue
        try:  # MS_BIND makes this a per-mount change: the host's mount stays writable
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError as exc:
            readonly = False
            notes.append(f"could not make {point} read-only ({exc})")
    if readonly:
        layers.append("readonly_fs")
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={req['disk_mb']}m,nr_inodes=16384,mode=1777")
    mask_homes(req, layers, notes)
    for extra in ("/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(extra) and not os.path.islink(extra):
            try:
                mount("/tmp", extra, None, MS_BIND)
            except OSError as exc:
                notes.append(f"could not hide {extra} ({exc})")
    os.mkdir(WORKDIR_IN_NAMESPACE, 0o700)
    return WORKDIR_IN_NAMESPACE


def mask_homes(req, layers, notes):
    """Hide each masked directory under an empty tmpfs, re-exposing (read-only) the Python paths in it."""
    keep = req["python_paths"]
    masked = [m for m in req["mask"] if os.path.isdir(m) and m != "/" and not any(under(m, k) for k in keep)]
    if not masked:
        return
    staged = []
    for i, path in enumerate(p for p in keep if any(under(p, m) for m in masked)):
        stage = f"/tmp/.stage{i}"
        os.mkdir(stage)
        mount(path, stage, None, MS_BIND | MS_REC)
        staged.append((stage, path))
    for m in masked:
        mount("tmpfs", m, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for stage, path in staged:
        os.makedirs(path, 0o755, exist_ok=True)
        mount(stage, path, None, MS_BIND | MS_REC)
        flags = dict(mountinfo()).get(path, 0)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        check(libc().umount2(stage.encode(), MNT_DETACH), f"umount {stage}")
        os.rmdir(stage)
    layers.append("masked_home")


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


def python_layout():
    """This interpreter's installation (to keep visible) and its site-packages (to import from)."""
    import site

    site_dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    prefixes = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site_dirs)
    paths = sorted({os.path.realpath(p) for p in prefixes})
    paths = [p for p in paths if not any(p != q and under(p, q) for q in paths)]
    return {"python_paths": paths, "site_dirs": site_dirs}


# --- the supervisor --------------------------------------------------------------------------


def main():
    global _victim
    req = marshal.loads(sys.stdin.buffer.read())
    if req.get("python_paths") is None:
        req.update(python_layout())
    status_fd = req["status_fd"]
    os.set_inheritable(status_fd, False)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    notes, layers = [], []
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if LINUX:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the trainer died: so do we
            if os.getppid() != req["parent_pid"]:
                os._exit(1)
        ns = enter_namespaces(req, notes) if LINUX and req["namespaces"] is not False else None
        if ns is None and req["namespaces"]:
            raise RuntimeError("namespaces were required (namespaces=True) but " + "; ".join(notes))
    except Exception as exc:
        report(status_fd, event="error", message=f"{type(exc).__name__}: {exc}")
        os._exit(1)
    if ns is None:
        supervise(req, status_fd, devnull, layers, notes, in_namespace=False)
    layers += ns
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            supervise(req, status_fd, devnull, layers, notes, in_namespace=True)
        except BaseException as exc:  # noqa: BLE001 - reported, never raised into the host
            report(status_fd, event="error", message=f"{type(exc).__name__}: {exc}")
        os._exit(1)
    _victim = pid
    os.close(status_fd)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    while True:
        try:
            os.waitpid(pid, 0)
            break
        except ChildProcessError:
            break
    os._exit(0)


def supervise(req, status_fd, devnull, layers, notes, in_namespace):
    """Prepare the working directory and identity, fork the code, wait, clean up. Never returns."""
    global _victim
    try:
        if in_namespace:
            try:
                workdir = set_up_mounts(req, layers, notes)
            except OSError as exc:
                report(status_fd, event="error", stage="namespaces", message=f"{type(exc).__name__}: {exc}")
                os._exit(1)
        else:
            workdir = os.path.join(req["tmp_root"], "rlhf-sandbox-" + os.urandom(6).hex())
            os.mkdir(workdir, 0o700)
            if LINUX:
                prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the code come back to us
        uid = req["uid"]
        if uid is not None and not uid_mapped(uid):  # root inside a user namespace (rootless container)
            notes.append(f"kept uid 0: uid {uid} does not exist in this user namespace")
            uid = None
        if uid is not None and not all(traversable(p, uid) for p in req["python_paths"]):
            if req["drop_privileges"]:
                raise RuntimeError(f"uid {uid} cannot read the Python installation {req['python_paths']}")
            notes.append("kept uid 0: the Python installation is not readable by other users")
            uid = None
        if uid is not None:
            os.chown(workdir, uid, uid)
            layers.append("uid")
        caps = os.geteuid() == 0 or "user_ns" in layers
        nproc = uid is not None or "user_ns" in layers or os.geteuid() != 0
        if nproc:
            layers.append("nproc")
        layers.append("rlimits")
        rules = guard_rules(req["python_guard"], layers, nproc)
        if rules:
            layers.append("guard:" + ",".join(rules))
        report(status_fd, event="start", isolation=layers, notes=notes, workdir=workdir)
    except BaseException as exc:  # noqa: BLE001
        report(status_fd, event="error", message=f"{type(exc).__name__}: {exc}")
        os._exit(1)

    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:
        run(req, status_fd, devnull, workdir, uid, caps, nproc, rules, supervisor)
    try:
        os.setpgid(pid, pid)  # the code leads its own process group (it does the same: no race)
    except OSError:
        pass
    if not in_namespace:
        report(status_fd, event="spawned", pid=pid)
    _victim = pid
    os.dup2(devnull, 1)  # from now on only the code holds the output pipes
    os.dup2(devnull, 2)
    while True:
        try:
            child, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            status, usage = 0, None
            break
        if child == pid:
            break
    message = {"event": "exit", "returncode": None, "signal": None,
               "cpu_s": usage.ru_utime + usage.ru_stime if usage else None}
    if os.WIFSIGNALED(status):
        message["signal"] = os.WTERMSIG(status)
    else:
        message["returncode"] = os.waitstatus_to_exitcode(status)
    if not in_namespace:
        kill_descendants(pid, uid)
    report(status_fd, **message)
    if not in_namespace:
        remove_tree(workdir)
    os._exit(0)  # as pid 1, our exit makes the kernel kill everything left in the namespace


def guard_rules(setting, layers, nproc):
    """Which audit-hook rules to install: all, none, or (auto) those covering a missing layer."""
    if setting is False:
        return []
    if setting is True:
        return ["network", "files", "procs", "fork", "exec"]
    rules = []
    if "net_ns" not in layers:
        rules.append("network")
    if "readonly_fs" not in layers:
        rules.append("files")
    if "pid_ns" not in layers and "uid" not in layers:
        rules.append("procs")
    if not nproc:
        rules.append("fork")
    if rules:
        rules.append("exec")  # a new program would run without the hook
    return rules


def kill_descendants(pgid, uid, deadline_s=5.0):
    """Kill and reap every process the code left, daemons included (without namespaces).

    Atomic kills first, so a fork bomb cannot outrun us: the code's process group, then (with
    a per-call uid) every process of that uid. What escaped both (setsid, same uid as us) was
    re-parented to us, the child subreaper: kill our children until none is left.
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    if uid is not None:
        helper = os.fork()
        if helper == 0:
            try:
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)  # as uid: every process of uid but this one
            finally:
                os._exit(0)
    me, deadline = os.getpid(), time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            continue
        for child in children_of(me):
            for kill in (os.killpg, os.kill):
                try:
                    kill(child, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.002)


def children_of(ppid):
    kids = []
    for name in os.listdir("/proc") if LINUX else ():
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == ppid:
                kids.append(int(name))
    return kids


def remove_tree(path):
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass
        for name in dirs:
            full = os.path.join(root, name)
            try:
                os.rmdir(full) if not os.path.islink(full) else os.unlink(full)
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


if __name__ == "__main__":
    main()
