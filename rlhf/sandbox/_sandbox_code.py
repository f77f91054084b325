"""The code's process of one sandboxed execution, and the OS calls both halves share.

Imported by ``_sandbox_child.py`` (the supervisor, run as ``python -I -S``), never by rlhf:
`run` turns a fork of the supervisor into the code's process (limits, identity, a fresh
``__main__``), runs the code and exits; the best-effort audit hook used where an OS layer is
missing is in ``_sandbox_guard.py``. Standard library only, cheap imports only.
"""

import _signal as signal  # the C module: `signal` would import enum, ~8 ms at every start
import marshal
import os
import resource
import sys

from _sandbox_guard import make_guard  # noqa: E402 - a sibling, found through the supervisor's sys.path

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
LINUX = sys.platform.startswith("linux")
HERE = os.path.dirname(os.path.abspath(__file__))
OWN_FILES = {os.path.join(HERE, name) for name in ("_sandbox_code.py", "_sandbox_child.py", "_sandbox_guard.py")}  # hidden

_libc = None


def libc():
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        ul = ctypes.c_ulong
        _libc.prctl.argtypes = [ctypes.c_int, ul, ul, ul, ul]
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ul, ctypes.c_char_p]
        _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        _libc.unshare.argtypes = [ctypes.c_int]
        _libc.capset.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return _libc


def check(ret, what):
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option, arg):
    check(libc().prctl(option, arg, 0, 0, 0), f"prctl({option})")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def report(fd, **message):
    data = marshal.dumps(message)
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


# --- the code's process ----------------------------------------------------------------------


def run(req, status_fd, devnull, workdir, uid, caps, nproc, rules, supervisor, seccomp):
    """Become the code's process: limits, identity, fresh ``__main__``; run; exit. Never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setpgid(0, 0)
        stdin = req["stdin"]
        if stdin:
            fd = os.memfd_create("stdin") if hasattr(os, "memfd_create") else None
            if fd is None:
                raise RuntimeError("stdin needs os.memfd_create")
            view = memoryview(stdin)
            while view:
                view = view[os.write(fd, view):]
            os.lseek(fd, 0, os.SEEK_SET)
            os.dup2(fd, 0)
            os.close(fd)
        os.close(devnull)
        os.chdir(workdir)
        set_limits(req, uid, nproc)
        if req.get("cgroup_layers") and LINUX:
            with open("/proc/self/oom_score_adj", "w") as f:  # the supervisors are exempt, the code is not
                f.write("0")
        if caps and LINUX:
            with open("/proc/sys/kernel/cap_last_cap") as f:
                last = int(f.read())
            for cap in range(last + 1):
                prctl(PR_CAPBSET_DROP, cap)
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        if caps and LINUX:
            import ctypes

            header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
            data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable = nothing
            check(libc().capset(header, data), "capset")
        if LINUX:
            prctl(PR_SET_NO_NEW_PRIVS, 1)
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            prctl(PR_SET_DUMPABLE, 1)  # a uid change cleared it; /proc/self must stay the code's own
            if os.getppid() != supervisor:
                os._exit(1)
        if seccomp:
            from _sandbox_seccomp import install

            install(libc())
        os.environ.update(HOME=workdir, TMPDIR=workdir, PWD=workdir)
        extra = [*req["site_dirs"], *req.get("source_dirs", ())] if req["site_packages"] else []
        sys.path[:] = ["", *sys.path, *extra]  # .pth files are not run: their path lines are these source_dirs
        if req["site_packages"] and req.get("editable_modules"):  # and their import hooks, these finders
            sys.meta_path.append(EditableFinder(req["editable_modules"]))
        if req["site_packages"] and req.get("editable_redirects"):
            sys.meta_path.insert(0, RedirectFinder(req["editable_redirects"]))
        sys.argv[:] = ["-c"]
        sys.dont_write_bytecode = True
        sys.stdout.reconfigure(line_buffering=True)
        main_module = type(sys)("__main__")
        main_module.__builtins__ = sys.modules["builtins"]
        sys.modules["__main__"] = main_module
        if rules:
            sys.addaudithook(make_guard(set(rules), workdir))
    except BaseException as exc:  # noqa: BLE001
        report(status_fd, event="error", message=f"setting up the code's process failed: {type(exc).__name__}: {exc}")
        os._exit(1)
    os.close(status_fd)
    if req["prelude"]:
        run_silently(req["prelude"], main_module.__dict__)
    code = req["code"]
    exit_code = 0
    try:
        exec(compile(code, "<string>", "exec"), main_module.__dict__)
    except SystemExit as exc:
        exit_code = exit_code_of(exc)
    except BaseException as exc:  # noqa: BLE001 - printed like the interpreter does
        print_exception(exc, code)
        exit_code = 1
    finish(exit_code)


class EditableFinder:
    """What the import hooks of editable installs do (setuptools' finder, ``editables``), read
    from their literal mappings on the host (``_sandbox_editable.py``): a top-level name found
    at its folder (a package, or a namespace package over several), or its module file. Last on
    ``sys.meta_path``, as theirs are."""

    def __init__(self, modules):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        paths = self.modules.get(fullname) if path is None else None
        if not paths:
            return None
        from importlib.machinery import ModuleSpec, all_suffixes
        from importlib.util import spec_from_file_location

        if len(paths) == 1:
            where = paths[0]
            init = os.path.join(where, "__init__.py")
            if os.path.isfile(init):
                return spec_from_file_location(fullname, init, submodule_search_locations=[where])
            stem = os.path.splitext(where)[0]
            for candidate in (where, *(stem + suffix for suffix in all_suffixes())):
                if os.path.isfile(candidate):
                    return spec_from_file_location(fullname, candidate)
        folders = [p for p in paths if os.path.isdir(p)]
        if not folders:
            return None
        spec = ModuleSpec(fullname, None, is_package=True)  # a namespace package
        spec.submodule_search_locations = folders
        return spec


class RedirectFinder:
    """What meson-python's and scikit-build-core's editable finders do, read on the host
    (``_sandbox_editable.py``: meson's install plan, scikit-build-core's literal mappings): each
    module's file and each package's folders, by dotted name; first on ``sys.meta_path``, as
    theirs are. It never rebuilds the project (theirs do, on the first import): it imports the
    files as the last build outside left them."""

    def __init__(self, redirects):
        self.redirects = redirects

    def find_spec(self, fullname, path=None, target=None):
        entry = self.redirects.get(fullname)
        if entry is None:
            return None
        from importlib.machinery import ModuleSpec
        from importlib.util import spec_from_file_location

        file, folders = entry
        if file is None:  # a namespace package
            spec = ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [f for f in folders if os.path.isdir(f)]
            return spec
        if not os.path.isfile(file):
            return None
        package = os.path.basename(file).startswith("__init__.")
        return spec_from_file_location(fullname, file, submodule_search_locations=list(folders) if package else None)


def run_silently(prelude, namespace):
    """Run ``prelude`` in the code's namespace, its output and errors discarded."""
    saved = sys.stdout, sys.stderr
    try:
        with open(os.devnull, "w") as sink:
            sys.stdout = sys.stderr = sink
            exec(compile(prelude, "<prelude>", "exec"), namespace)
    except BaseException:  # noqa: BLE001 - a failing prelude is the code's business
        pass
    finally:
        sys.stdout, sys.stderr = saved


def exit_code_of(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    try:
        print(exc.code, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def print_exception(exc, code):
    try:
        import linecache
        import traceback

        linecache.cache["<string>"] = (len(code), None, code.splitlines(True), "<string>")
        traceback.print_exception(type(exc), exc, without_own_frames(exc.__traceback__))
    except BaseException:  # noqa: BLE001
        os.write(2, f"{type(exc).__name__}: {exc}\n".encode(errors="replace"))


def without_own_frames(tb):
    """The traceback without this file's frames (the exec call, the guard): only the code's."""
    head = last = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename not in OWN_FILES:
            if last is None:
                head = tb
            else:
                last.tb_next = tb
            last = tb
        tb = tb.tb_next
    if last is not None:
        last.tb_next = None
    return head


def finish(exit_code):
    """What the interpreter does at exit: join threads, run atexit, flush; then leave at once."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as exc:
        exit_code = exit_code_of(exc)
    except BaseException as exc:  # noqa: BLE001
        print_exception(exc, "")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            exit_code = exit_code or 120
    os._exit(exit_code)


def set_limits(req, uid, nproc):
    mb = 1024 * 1024
    limits = [
        (resource.RLIMIT_AS, req["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, req["max_file_size_mb"] * mb),
        (resource.RLIMIT_NOFILE, req["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ]
    if nproc:
        extra = 0 if uid is not None or os.geteuid() == 0 else count_tasks(os.getuid())
        limits.append((resource.RLIMIT_NPROC, req["max_processes"] + extra))
    for which, value in limits:
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
    cpu = req["cpu_time_s"]
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft, hard_new = cpu, cpu + 1  # SIGXCPU first, SIGKILL one second later
    if hard != resource.RLIM_INFINITY:
        soft, hard_new = min(soft, hard), min(hard_new, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard_new))


def count_tasks(uid):
    """Tasks (threads) ``uid`` runs now: RLIMIT_NPROC counts them all, the host's included."""
    total = 0
    for name in os.listdir("/proc") if LINUX else ():
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    total += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return total
