"""Supervisor of one sandboxed execution; the other half of ``rlhf.sandbox``.

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
from _sandbox_code import LINUX, PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl, report, run  # noqa: E402
from _sandbox_mounts import enter_namespaces, set_up_mounts, traversable, uid_mapped  # noqa: E402
from _sandbox_seccomp import supported as seccomp_supported  # noqa: E402
from _sandbox_view import python_layout  # noqa: E402
from _sandbox_watchdog import MemoryWatchdog  # noqa: E402

del sys.path[0]

_victim = 0  # the process a SIGTERM from the host turns into a SIGKILL for


def on_sigterm(signum, frame):
    if _victim:
        for kill in (os.killpg, os.kill):  # without namespaces the victim leads the code's process group
            try:
                kill(_victim, signal.SIGKILL)
            except OSError:
                pass


# --- the supervisor --------------------------------------------------------------------------


def main():
    global _victim
    req = marshal.loads(sys.stdin.buffer.read())
    if req.get("python_paths") is None:
        req.update(python_layout(sys))
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
        join_cgroups(req, layers, notes)
        ns = enter_namespaces(req, notes, report) if LINUX and req["namespaces"] is not False else None
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
    workdir = None
    try:
        uid = req["uid"]
        if uid is not None and not uid_mapped(uid):  # root inside a user namespace (rootless container)
            notes.append(f"kept uid 0: uid {uid} does not exist in this user namespace")
            uid = None
        if in_namespace:
            try:
                workdir = set_up_mounts(req, layers, notes, uid)
            except OSError as exc:
                report(status_fd, event="error", stage="namespaces", message=f"{type(exc).__name__}: {exc}")
                os._exit(1)
        closed = [p for p in req["python_paths"] if uid is not None and not traversable(p, uid)]
        if closed:  # never silently stay root: the caller asked for uid 0 explicitly or gets an error
            raise RuntimeError(
                f"as root the code must run as an unprivileged uid, but uid {uid} cannot reach the Python "
                f"installation {closed[0]} (without mount namespaces it cannot be re-exposed): make its "
                f"directories readable by others (chmod o+rx), or pass drop_privileges=False to run as root")
        if not in_namespace:
            workdir = os.path.join(req["tmp_root"], "rlhf-sandbox-" + os.urandom(6).hex())
            os.mkdir(workdir, 0o700)
            if LINUX:
                prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the code come back to us
        if uid is not None:
            os.chown(workdir, uid, uid)
            layers.append("uid")
        caps = os.geteuid() == 0 or "user_ns" in layers
        nproc = uid is not None or "user_ns" in layers or os.geteuid() != 0
        if nproc:
            layers.append("nproc")
        layers.append("rlimits")
        seccomp = req.get("seccomp") is not False and LINUX and seccomp_available()
        if seccomp:
            layers.append("seccomp")
        elif req.get("seccomp"):
            raise RuntimeError("seccomp was required (seccomp=True) but this kernel or machine has no seccomp filter")
        elif req.get("seccomp") is None:
            notes.append("seccomp unavailable: exec and namespace system calls are not filtered")
        watchdog = None
        if "cgroup_memory" not in layers and LINUX:
            watchdog = MemoryWatchdog((req["memory_mb"] << 20))
            layers.append("memory_watchdog")
        rules = guard_rules(req["python_guard"], layers, nproc)
        if rules:
            layers.append("guard:" + ",".join(rules))
        report(status_fd, event="start", isolation=layers, notes=notes, workdir=workdir)
    except BaseException as exc:  # noqa: BLE001
        if workdir and not in_namespace:
            remove_tree(workdir)
        report(status_fd, event="error", message=f"{type(exc).__name__}: {exc}")
        os._exit(1)

    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:
        run(req, status_fd, devnull, workdir, uid, caps, nproc, rules, supervisor, seccomp)
    try:
        os.setpgid(pid, pid)  # the code leads its own process group (it does the same: no race)
    except OSError:
        pass
    if not in_namespace:
        report(status_fd, event="spawned", pid=pid)
    _victim = pid
    os.dup2(devnull, 1)  # from now on only the code holds the output pipes
    os.dup2(devnull, 2)
    if watchdog is not None:
        watchdog.start()
    while True:
        try:
            child, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            status, usage = 0, None
            break
        if child == pid:
            break
    if watchdog is not None:
        watchdog.stop()
    message = {"event": "exit", "returncode": None, "signal": None,
               "cpu_s": usage.ru_utime + usage.ru_stime if usage else None,
               "memory_exceeded": watchdog is not None and watchdog.exceeded}
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


def join_cgroups(req, layers, notes):
    """The host moved this process into the call's cgroups before sending the request: every
    process the code starts is in them too."""
    layers.extend(req.get("cgroup_layers") or ())
    if req.get("cgroup_layers") and os.geteuid() == 0:
        try:  # the memory limit's OOM killer must pick the code, never its supervisors
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("-1000")
        except OSError:
            pass


def seccomp_available():
    if not seccomp_supported():
        return False
    try:
        with open("/proc/self/status") as f:
            return any(line.startswith("Seccomp:") for line in f)
    except OSError:
        return False


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
    if not nproc and "cgroup_pids" not in layers:
        rules.append("fork")
    if rules:  # a new program, or C called through ctypes, would run without the hook (even with seccomp,
        rules.append("exec")  # ctypes could call open()/unlink() natively and go around the other rules)
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
