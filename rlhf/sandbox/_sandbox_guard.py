"""The best-effort Python guard of a sandboxed execution: a PEP 578 audit hook.

Imported by ``_sandbox_code.py``; installed only where an OS layer is missing (or on request).
`make_guard` returns the hook. It cannot be removed from Python, and its state cannot be reached
from the code: a refusal is raised by `_enter`, a module-level function whose only variables at
that point are the event and the message, never by a frame that holds the state (walking a
caught exception's traceback to ``f_locals`` would otherwise turn the guard off). Native code (a
C extension) still bypasses it: it stops accidents and naive attempts, not a determined attacker.
"""

import functools
import os


class _Refusal(Exception):
    pass


def _enter(decide, event, args):
    message = decide(event, args)
    if message is not None:
        del decide, args  # the traceback of the PermissionError shows this frame only
        raise PermissionError(f"sandbox: {message} is not allowed")


def make_guard(rules, workdir):
    """An audit hook refusing what the missing OS layers would have stopped (PEP 578).

    Best effort: it cannot be removed from Python, but native code (a C extension) bypasses it.
    """
    import _thread
    import posixpath

    me, local = os.getpid(), _thread._local()
    allowed_roots = (workdir.rstrip("/") + "/", "/dev/null", "/dev/stdout", "/dev/stderr")
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    file_events = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.link",
                   "os.symlink", "os.truncate", "os.utime", "os.mkfifo", "os.mknod", "shutil.rmtree",
                   "os.setxattr", "os.removexattr"}
    exec_events = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.startfile",
                   "sqlite3.enable_load_extension", "sqlite3.load_extension",
                   "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "ctypes.string_at", "ctypes.wstring_at",
                   "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames"}
    net_events = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                  "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
    getcwd, realpath, isabs, join, startswith = os.getcwd, posixpath.realpath, posixpath.isabs, posixpath.join, str.startswith

    def inside(path):
        if isinstance(path, int):
            return True
        path = os.fsdecode(path)
        full = realpath(path if isabs(path) else join(getcwd(), path))
        return full + "/" == allowed_roots[0] or any(startswith(full, root) for root in allowed_roots)

    def descendant(pid):
        for _ in range(64):
            if pid == me:
                return True
            if pid <= 1:
                return False
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                return False
            pid = int(stat[stat.rindex(b")") + 2:].split()[1])
        return False

    def refuse(what):
        raise _Refusal(what)

    def other_pid(path):
        """The pid in a /proc/PID/... path when PID is not us or a descendant, else None."""
        path = realpath(os.fsdecode(path))
        if not startswith(path, "/proc/"):
            return None
        part = path[6:].split("/", 1)[0]
        return int(part) if part.isdigit() and not descendant(int(part)) else None

    def decide(event, args):
        """What to refuse (a message) or None; never raises, so none of these frames, whose
        variables hold the guard's state, ever reaches the code through a traceback."""
        if getattr(local, "busy", False):  # our own checks open /proc files: do not recurse
            return None
        local.busy = True
        try:
            check(event, args)
        except _Refusal as refusal:
            return str(refusal)
        except BaseException:  # noqa: BLE001 - a check that fails refuses (fail closed)
            return f"{event} (the sandbox could not check it)"
        finally:
            local.busy = False
        return None

    def check(event, args):
        if "exec" in rules and event in exec_events:
            refuse(event)
        elif "network" in rules and event in net_events:
            refuse("network access")
        elif "fork" in rules and event in ("os.fork", "os.forkpty"):
            refuse(event)
        elif "procs" in rules and event in ("os.kill", "os.killpg"):
            if event == "os.killpg" or args[0] <= 0 or not descendant(args[0]):
                refuse("signalling other processes")
        elif event == "open":
            path, mode, flags = args
            if "procs" in rules and isinstance(path, (str, bytes)) and other_pid(path) is not None:
                refuse("reading other processes' /proc entries")
            if "files" in rules:
                writes = (mode is not None and any(c in mode for c in "wax+")) or (
                    mode is None and isinstance(flags, int) and flags & write_flags)
                if writes and path is not None and not inside(path):
                    refuse(f"writing {path!r} outside the working directory")
        elif "files" in rules and event == "sqlite3.connect":  # SQLite writes files natively (ATTACH too)
            refuse("sqlite3 without a read-only filesystem")
        elif "files" in rules and event in file_events:
            paths = args[:2] if event in ("os.rename", "os.link") else args[1:2] if event == "os.symlink" else args[:1]
            if not all(inside(p) for p in paths if isinstance(p, (str, bytes))):
                refuse(f"{event} outside the working directory")

    return functools.partial(_enter, decide)
