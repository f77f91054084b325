"""Run untrusted Python in a separate, contained process: ``run_code(code) -> SandboxResult``.

Standalone: standard library only (with ``_sandbox_child.py`` and ``_sandbox_code.py``, the
supervisor it starts), usable without the rest of rlhf::

    from rlhf.plugins.envs.sandbox import run_code
    result = run_code("print(6 * 7)", timeout_s=2)
    result.status, result.stdout        # ("ok", "42\\n")

``run_code`` never raises for anything the code does: an exception, ``sys.exit``, a timeout, a
crash or a limit becomes ``status`` ``"ok" | "error" | "timeout" | "killed" | "sandbox_error"``
with ``stdout``/``stderr`` (capped while reading, with ``*_truncated`` flags), ``returncode``,
``duration_s`` and ``isolation``: the layers actually enforced for this call. One call costs one
Python start-up (``python -I -S``) plus a fork: about 45 ms on a 2-core VM.

Every call: a new process in its own session with a scrubbed environment (PATH, locale,
one-thread BLAS settings and ``env=``; nothing inherited), a fresh empty working directory (also
HOME and TMPDIR), rlimits on address space, CPU seconds, file size, open files and core dumps, a
wall-clock timeout counted from when the code starts, output caps (a stream over 8x its cap
kills the program), no capabilities, ``no_new_privs``, a parent-death signal (if rlhf dies, so
does the sandbox), and clean-up of every process the code started, double-forked daemons
included. Then the strongest of these layers the OS allows (``namespaces``, ``drop_privileges``,
``seccomp``, ``cgroup``, ``python_guard``: ``None`` = when possible, ``True`` = required,
``False`` = off). A layer this machine cannot provide is named in a ``RuntimeWarning``, once:

================  ============================================================================
layer             effect (where)
================  ============================================================================
``pid_ns``        own pid namespace: the code sees and can signal only its own processes; when
                  its main process ends, the kernel kills the rest (root with CAP_SYS_ADMIN, or
                  any user where unprivileged user namespaces are allowed)
``net_ns``        own network namespace, no interface up: no network at all, loopback included
``mount_ns``      private ``/tmp`` (also ``/var/tmp``, ``/dev/shm``, ``/run/lock``): a tmpfs of
                  ``disk_mb`` holding the working directory, gone with the namespace
``readonly_fs``   every other mount read-only, ``/sys`` included (per mount: the host's stay
                  writable)
``proc``          a fresh ``/proc`` listing only the sandbox's processes
``proc_sys_ro``   ``/proc/sys``, ``/proc/sysrq-trigger`` and the other kernel knobs read-only
``minimal_dev``   ``/dev`` is a read-only tmpfs with only null, zero, full, random, urandom
``masked_etc``    ``/etc/shadow``, ``/etc/gshadow``, sudoers and ssh host keys read as empty
``masked_dirs``   home directories of the user running rlhf, ``hide_paths`` and any directory
                  an unprivileged uid could not cross on the way to Python replaced by empty
                  tmpfs; the Python installation (a venv too, even under ``/tmp``) stays
                  visible, read-only
``uid``           as root: the code always runs as a fresh unprivileged uid (random per call),
                  so file permissions protect the host and RLIMIT_NPROC applies. Without mount
                  namespaces, an installation that uid cannot reach is an error
                  (``sandbox_error``), never a silent uid 0: pass ``drop_privileges=False`` to
                  run as root on purpose
``user_ns``       not root: a user namespace instead (same uid, no capabilities)
``nproc``         RLIMIT_NPROC (``max_processes``) in force (never for uid 0)
``seccomp``       a seccomp filter: ``execve``/``execveat`` (no program ever starts, whatever
                  the path: ``subprocess``, ``_posixsubprocess``, ctypes), namespaces,
                  ``ptrace``, mounts, ``bpf``, ``io_uring``, keyrings, modules, clocks... fail
                  with EPERM (x86_64 and aarch64)
``cgroup_memory`` a cgroup per call (root, v2 or v1): ``memory_mb`` (+64 MiB for the
                  supervisors) of resident memory for all the code's processes together; going
                  over is ``killed`` with a message naming the limit
``cgroup_pids``   the same cgroup: ``max_processes`` tasks (threads included) for the whole tree
``memory_watchdog`` without a memory cgroup: the supervisor sums the tree's memory (PSS) every
                  50 ms and kills it over ``memory_mb`` (a poll: it can overshoot for one tick)
``guard:RULES``   best effort, by default only for what an OS layer above does not cover: a
                  PEP 578 audit hook refusing network calls (``network``), writes outside the
                  working directory (``files``), signals to and /proc reads of other processes
                  (``procs``), forks (``fork``), and starting programs or calling C through
                  ctypes (``exec``). Native code can get around it: it stops accidents and
                  naive attempts, not a determined attacker.
================  ============================================================================

Typical set-ups: root in a VM or a privileged container gets every layer; a normal user with
user namespaces gets all but ``uid`` and the cgroups; a Docker container without CAP_SYS_ADMIN
gets ``uid`` and ``nproc`` (when the interpreter is readable by other users), ``seccomp`` plus
the guard; elsewhere, rlimits, clean-up through a child subreaper, and the guard. If setting up
namespaces fails after ``unshare`` (e.g. AppArmor-restricted user namespaces), the call is
retried without them and later calls skip them. Never enforced: world-readable host files stay
readable (masked directories excepted), unix sockets on the filesystem stay reachable where file
permissions allow, and site-packages' ``.pth`` files are not run (``site_packages=True`` only
puts the directories on ``sys.path``; editable installs are not importable). ``memory_mb`` is
also the per-process address-space limit, so one process over it gets a ``MemoryError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import marshal
import math
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _sandbox_cgroup as _cgroup

__all__ = ["SandboxConfig", "SandboxResult", "run_code", "run_code_async", "set_max_concurrency"]

STATUSES = ("ok", "error", "timeout", "killed", "sandbox_error")
CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
SANDBOX_UIDS = (2_000_000, 2_100_000)  # root: each call runs as a random uid from this range
SETUP_TIMEOUT_S = 10.0  # the supervisor must be ready by then; the code's clock starts after
KILL_GRACE_S = 2.0  # after asking the supervisor to stop, how long until everything is SIGKILLed
OUTPUT_KILL_FACTOR = 8  # a stream this many times over its cap kills the program
CGROUP_OVERHEAD_MB = 64  # the supervisors share the call's cgroup: room for them on top of memory_mb
CGROUP_OVERHEAD_TASKS = 2  # the supervisor and, with namespaces, the pid namespace's init
EXPECTED_LAYERS = ("pid_ns", "net_ns", "mount_ns", "readonly_fs", "minimal_dev", "proc_sys_ro", "seccomp",
                   "cgroup_memory", "cgroup_pids")
_warned: set[tuple[str, ...]] = set()
_NO_NAMESPACES: set[str] = set()  # interpreters whose namespace set-up failed here: not retried
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1",
}


@dataclass(kw_only=True, frozen=True)
class SandboxConfig:
    """Limits and isolation settings of one execution."""

    timeout_s: float = field(default=10.0, metadata={"help": "wall-clock limit in seconds, from when the code starts"})
    memory_mb: int = field(default=1024, metadata={"help": "address-space limit (RLIMIT_AS) in MiB"})
    cpu_time_s: int | None = field(default=None, metadata={"help": "CPU seconds per process; default ceil(timeout_s) + 1"})
    max_processes: int = field(default=32, metadata={"help": "processes and threads (RLIMIT_NPROC), where enforceable"})
    max_file_size_mb: int = field(default=16, metadata={"help": "largest file the code may write (RLIMIT_FSIZE), MiB"})
    max_open_files: int = field(default=256, metadata={"help": "open file descriptors (RLIMIT_NOFILE)"})
    disk_mb: int = field(default=64, metadata={"help": "size of the private /tmp and working directory (tmpfs), MiB"})
    max_output_bytes: int = field(default=1 << 20, metadata={"help": "bytes kept per stream (stdout, stderr)"})
    env: dict[str, str] | None = field(default=None, metadata={"help": "extra environment variables for the code"})
    python: str | None = field(default=None, metadata={"help": "interpreter to run the code; default sys.executable"})
    site_packages: bool = field(default=True, metadata={"help": "put the interpreter's site-packages on sys.path"})
    namespaces: bool | None = field(default=None, metadata={"help": "pid/net/mount/ipc namespaces: None when possible"})
    drop_privileges: bool | None = field(default=None, metadata={"help": "as root, run as an unprivileged uid"})
    python_guard: bool | None = field(default=None, metadata={"help": "audit-hook guard; None: where OS layers are missing"})
    seccomp: bool | None = field(default=None, metadata={"help": "seccomp filter (no exec, no namespaces): None when possible"})
    cgroup: bool | None = field(default=None, metadata={"help": "memory and process limits on the whole tree: None when possible"})
    hide_paths: tuple[str, ...] = field(default=(), metadata={"help": "more directories to mask (with namespaces)"})

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_processes", "max_file_size_mb", "max_open_files", "disk_mb",
                     "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(kw_only=True)
class SandboxResult:
    """What one execution did. ``message`` explains any status but ``ok`` in one line."""

    status: str  # one of STATUSES
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None  # exit code of the code's process; None when it did not exit
    signal: int | None = None  # the signal that killed it
    duration_s: float = 0.0  # wall clock of the whole call, start-up included
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    message: str = ""
    cpu_s: float | None = None
    isolation: tuple[str, ...] = ()  # layers enforced, see the module docstring

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_code(code: str, *, stdin: str | bytes = "", prelude: str = "", config: SandboxConfig | None = None,
             **overrides: Any) -> SandboxResult:
    """Run ``code`` (Python source) in a new sandboxed process and wait for it.

    ``overrides`` are `SandboxConfig` fields (``timeout_s=2``, ``memory_mb=256``, ...) applied on
    top of ``config``. ``stdin`` is what the code reads from standard input. ``prelude`` runs
    first in the same namespace with its output and errors discarded (a notebook-like
    environment replays earlier cells this way); the timeout covers both.
    """
    if not isinstance(code, str) or not isinstance(prelude, str):
        raise TypeError(f"code and prelude must be str, got {type(code).__name__} and {type(prelude).__name__}")
    config = dataclasses.replace(config or SandboxConfig(), **overrides)
    python = config.python or sys.executable
    if config.namespaces is None and python in _NO_NAMESPACES:
        config = dataclasses.replace(config, namespaces=False)
    started = time.monotonic()
    try:
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        execution = _Execution(code, stdin_bytes, prelude, config)
        result = execution.run()
        if config.namespaces is None and (execution.event("error") or {}).get("stage") == "namespaces":
            _NO_NAMESPACES.add(python)  # e.g. user namespaces that grant no capabilities (AppArmor)
            return run_code(code, stdin=stdin, prelude=prelude, config=dataclasses.replace(config, namespaces=False))
        return result
    except Exception as exc:  # our failure (or the OS's), never the code's doing
        return SandboxResult(status="sandbox_error", message=f"{type(exc).__name__}: {exc}",
                             duration_s=time.monotonic() - started)


# --- async: a bounded pool, so many trajectories run code without blocking the event loop ------

_executor_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_max_concurrency = int(os.environ.get("RLHF_SANDBOX_MAX_CONCURRENCY", "0")) or max(4, os.cpu_count() or 1)


def set_max_concurrency(n: int) -> None:
    """How many executions ``run_code_async`` runs at once in this process (default: CPU count,
    at least 4; or ``RLHF_SANDBOX_MAX_CONCURRENCY``). Calls over the bound wait their turn."""
    global _executor, _max_concurrency
    if n < 1:
        raise ValueError(f"max concurrency must be >= 1, got {n}")
    with _executor_lock:
        _max_concurrency = n
        if _executor is not None:
            _executor.shutdown(wait=False)
            _executor = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=_max_concurrency, thread_name_prefix="rlhf-sandbox")
        return _executor


async def run_code_async(code: str, *, stdin: str | bytes = "", prelude: str = "",
                         config: SandboxConfig | None = None, **overrides: Any) -> SandboxResult:
    """`run_code` on a bounded thread pool; awaiting it never blocks the event loop."""
    call = functools.partial(run_code, code, stdin=stdin, prelude=prelude, config=config, **overrides)
    return await asyncio.get_running_loop().run_in_executor(_pool(), call)


# --- one execution ----------------------------------------------------------------------------


class _Execution:
    def __init__(self, code: str, stdin: bytes, prelude: str, config: SandboxConfig):
        self.code, self.stdin, self.prelude, self.config = code, stdin, prelude, config
        self.events: list[dict[str, Any]] = []
        self.reason: str | None = None  # "timeout" or "output" when we stopped it
        self.uid: int | None = None
        self.oom_killed = False

    def request(self, status_fd: int, group: _cgroup.Cgroup | None) -> dict[str, Any]:
        cfg = self.config
        is_root = os.geteuid() == 0
        if cfg.drop_privileges and not is_root:
            raise PermissionError("drop_privileges=True needs root; leave it None to use what is available")
        if is_root and cfg.drop_privileges is not False:
            self.uid = random.randrange(*SANDBOX_UIDS)
        homes = {os.path.expanduser("~")}
        try:
            import pwd

            homes.add(pwd.getpwuid(os.getuid()).pw_dir)
        except (ImportError, KeyError):
            pass
        return {
            "code": self.code, "stdin": self.stdin, "prelude": self.prelude, "status_fd": status_fd, "parent_pid": os.getpid(),
            "memory_mb": cfg.memory_mb, "cpu_time_s": cfg.cpu_time_s or math.ceil(cfg.timeout_s) + 1,
            "max_processes": cfg.max_processes, "max_file_size_mb": cfg.max_file_size_mb,
            "max_open_files": cfg.max_open_files, "disk_mb": cfg.disk_mb, "site_packages": cfg.site_packages,
            "namespaces": cfg.namespaces, "drop_privileges": cfg.drop_privileges, "python_guard": cfg.python_guard,
            "uid": self.uid, "tmp_root": tempfile.gettempdir(), "seccomp": cfg.seccomp,
            "cgroup_layers": [],  # filled in once the supervisor is in the call's cgroups
            "mask": sorted({os.path.realpath(p) for p in (*homes, *cfg.hide_paths) if p}),
            **(_python_layout() if cfg.python in (None, sys.executable) else {}),
        }

    def run(self) -> SandboxResult:
        cfg = self.config
        started = time.monotonic()
        self.group = None
        if cfg.cgroup is not False and sys.platform.startswith("linux"):
            self.group = _cgroup.create((cfg.memory_mb + CGROUP_OVERHEAD_MB) << 20, cfg.max_processes + CGROUP_OVERHEAD_TASKS)
            missing = {"cgroup_memory", "cgroup_pids"} - set(self.group.layers)
            if missing and cfg.cgroup:
                _cgroup.remove(self.group)
                raise RuntimeError(f"cgroup=True but {', '.join(sorted(missing))} is not available (needs root and a "
                                   "writable cgroup hierarchy with that controller)")
        status_r, status_w = os.pipe()
        try:
            request = self.request(status_w, self.group)
            env = {**BASE_ENV, **(cfg.env or {})}
            try:
                proc = subprocess.Popen(
                    [cfg.python or sys.executable, "-I", "-S", CHILD], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,), env=env, cwd="/",
                    start_new_session=True,
                )
            finally:
                os.close(status_w)
            if self.group is not None:  # while the supervisor starts up (it waits for the request)
                request["cgroup_layers"] = _cgroup.join(self.group, proc.pid)
            payload = marshal.dumps(request)
            try:
                out, err, seen = self.communicate(proc, payload, status_r)
            finally:
                self.clean_up(proc)
        finally:
            os.close(status_r)
            if self.group is not None:
                self.oom_killed = self.group.oom_killed()
                _cgroup.remove(self.group)
        return self.result(out, err, seen, time.monotonic() - started)

    def communicate(self, proc: subprocess.Popen, payload: bytes, status_r: int) -> tuple[bytes, bytes, dict[str, int]]:
        cfg = self.config
        assert proc.stdin and proc.stdout and proc.stderr
        fd_in, fd_out, fd_err = proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno()
        kept = {fd_out: bytearray(), fd_err: bytearray()}
        seen = {fd_out: 0, fd_err: 0}
        status = bytearray()
        pending = memoryview(payload)
        os.set_blocking(fd_in, False)
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        stopping_at: float | None = None
        with selectors.DefaultSelector() as sel:
            sel.register(fd_in, selectors.EVENT_WRITE)
            for fd in (fd_out, fd_err, status_r):
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                now = time.monotonic()
                if stopping_at is None and now >= deadline:
                    self.stop(proc, "timeout" if self.started else "setup")
                    stopping_at = now
                if stopping_at is not None and now >= stopping_at + KILL_GRACE_S:
                    break  # clean_up kills what is left
                limit = deadline if stopping_at is None else stopping_at + KILL_GRACE_S
                for key, _ in sel.select(timeout=max(0.0, limit - now)):
                    fd = key.fd
                    if fd == fd_in:
                        try:
                            pending = pending[os.write(fd, pending[:1 << 16]):]
                        except (BrokenPipeError, BlockingIOError) as exc:
                            if isinstance(exc, BrokenPipeError):
                                pending = pending[:0]
                        if not pending:
                            sel.unregister(fd)
                            proc.stdin.close()
                        continue
                    try:
                        data = os.read(fd, 1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(fd)
                    elif fd == status_r:
                        status += data
                        was_started = self.started
                        self.parse_events(status)
                        if self.started and not was_started:
                            deadline = time.monotonic() + cfg.timeout_s
                    else:
                        seen[fd] += len(data)
                        room = cfg.max_output_bytes - len(kept[fd])
                        if room > 0:
                            kept[fd] += data[:room]
                        if seen[fd] > OUTPUT_KILL_FACTOR * cfg.max_output_bytes and stopping_at is None:
                            self.stop(proc, "output")
                            stopping_at = time.monotonic()
        return bytes(kept[fd_out]), bytes(kept[fd_err]), {"stdout": seen[fd_out], "stderr": seen[fd_err]}

    @property
    def started(self) -> bool:
        return any(e.get("event") == "start" for e in self.events)

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == name), None)

    def parse_events(self, buf: bytearray) -> None:
        while len(buf) >= 4:
            size = int.from_bytes(buf[:4], "big")
            if len(buf) < 4 + size:
                return
            self.events.append(marshal.loads(bytes(buf[4:4 + size])))
            del buf[:4 + size]

    def stop(self, proc: subprocess.Popen, reason: str) -> None:
        """Ask the supervisor to kill the code (it then cleans up and reports)."""
        self.reason = reason
        try:
            proc.send_signal(signal.SIGTERM)
        except OSError:
            pass

    def clean_up(self, proc: subprocess.Popen) -> None:
        """Whatever happened: nothing of this execution may outlive the call."""
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        try:
            proc.wait(timeout=KILL_GRACE_S if self.event("exit") or self.event("error") else 0.05)
        except subprocess.TimeoutExpired:
            pass
        try:  # the supervisor's process group: itself and, without namespaces, the code
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.kill()
        proc.wait()
        start = self.event("start") or {}
        layers = start.get("isolation", ())
        if "pid_ns" not in layers and not self.event("exit"):  # the supervisor could not clean up
            spawned = self.event("spawned")
            if spawned:
                try:
                    os.killpg(spawned["pid"], signal.SIGKILL)
                except OSError:
                    pass
            if self.uid is not None:
                _kill_uid(self.uid)
        workdir = start.get("workdir")
        if workdir and "mount_ns" not in layers and os.path.basename(workdir).startswith("rlhf-sandbox-"):
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)

    def result(self, out: bytes, err: bytes, seen: dict[str, int], duration: float) -> SandboxResult:
        cfg = self.config
        start, exit_, error = self.event("start") or {}, self.event("exit"), self.event("error")
        stderr = err.decode("utf-8", errors="replace")
        res = SandboxResult(
            status="ok", stdout=out.decode("utf-8", errors="replace"), stderr=stderr, duration_s=duration,
            stdout_truncated=seen["stdout"] > cfg.max_output_bytes,
            stderr_truncated=seen["stderr"] > cfg.max_output_bytes,
            isolation=tuple(start.get("isolation", ())),
        )
        _warn_missing_layers(start, cfg)
        if exit_ is not None:
            res.returncode, res.signal, res.cpu_s = exit_["returncode"], exit_["signal"], exit_["cpu_s"]
            self.oom_killed = self.oom_killed or bool(exit_.get("memory_exceeded"))
        if error is not None:
            res.status, res.message = "sandbox_error", f"sandbox set-up failed: {error['message']}"
        elif self.reason == "timeout":
            res.status, res.message = "timeout", f"wall-clock timeout: still running after {cfg.timeout_s:g} s"
        elif self.reason == "setup":
            res.status, res.message = "sandbox_error", f"the sandbox did not start within {SETUP_TIMEOUT_S:g} s"
        elif self.reason == "output":
            res.status = "killed"
            res.message = f"output limit: more than {OUTPUT_KILL_FACTOR * cfg.max_output_bytes} bytes written"
        elif exit_ is None:
            tail = stderr.strip().splitlines()[-1:] or ["no report"]
            res.status, res.message = "sandbox_error", f"the sandbox supervisor ended early: {tail[0][:300]}"
        elif res.signal is not None:
            res.status, res.message = "killed", _signal_message(res.signal, res.cpu_s, cfg)
            if self.oom_killed:
                res.message = f"killed: memory limit ({cfg.memory_mb} MiB for all the code's processes together)"
        elif self.oom_killed:
            res.status = "killed"
            res.message = f"a process was killed: memory limit ({cfg.memory_mb} MiB for all the code's processes together)"
        elif res.returncode != 0:
            last = stderr.strip().splitlines()[-1:] or [f"exit code {res.returncode}"]
            res.status, res.message = "error", last[0][:300]
            if last[0].startswith("MemoryError"):
                res.message += f" (memory limit {cfg.memory_mb} MiB)"
        return res


def _warn_missing_layers(start: dict[str, Any], cfg: SandboxConfig) -> None:
    """Warn once per process for each set of isolation layers this machine could not provide
    (layers the config turned off are not warned about)."""
    if not start:
        return
    layers = set(start.get("isolation", ()))
    off = {"seccomp"} if cfg.seccomp is False else set()
    off |= {"cgroup_memory", "cgroup_pids"} if cfg.cgroup is False else set()
    off |= {"pid_ns", "net_ns", "mount_ns", "readonly_fs", "minimal_dev", "proc_sys_ro"} if cfg.namespaces is False else set()
    missing = [name for name in EXPECTED_LAYERS if name not in layers and name not in off]
    if os.geteuid() == 0 and not {"uid", "user_ns"} & layers and cfg.drop_privileges is not False:
        missing.append("uid")
    key = tuple(missing)
    if missing and key not in _warned:
        _warned.add(key)
        notes = "; ".join(start.get("notes", ()))
        warnings.warn(f"rlhf sandbox: isolation layers not available on this machine: {', '.join(missing)}"
                      f"{f' ({notes})' if notes else ''}; active: {', '.join(sorted(layers))}",
                      RuntimeWarning, stacklevel=4)


@functools.lru_cache(maxsize=1)
def _python_layout() -> dict[str, list[str]]:
    """This interpreter's installation (kept visible to the code) and its site-packages; the
    supervisor computes the same itself when it runs another interpreter."""
    import site

    site_dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    prefixes = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site_dirs)
    paths = sorted({os.path.realpath(p) for p in prefixes})
    paths = [p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths)]
    return {"python_paths": paths, "site_dirs": site_dirs}


def _signal_message(signum: int, cpu_s: float | None, cfg: SandboxConfig) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    cpu_limit = cfg.cpu_time_s or math.ceil(cfg.timeout_s) + 1
    if signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_s is not None and cpu_s >= cpu_limit - 0.5):
        return f"killed by {name}: CPU time limit ({cpu_limit} s)"
    if signum == signal.SIGXFSZ:
        return f"killed by {name}: file size limit ({cfg.max_file_size_mb} MiB)"
    if signum == signal.SIGSEGV:
        return f"killed by {name}: the process crashed (memory limit {cfg.memory_mb} MiB?)"
    return f"killed by {name}"


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (the per-call sandbox uid) until none is left."""
    for _ in range(100):
        pids = []
        for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
            try:
                if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                    pids.append(int(name))
            except OSError:
                continue
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


if __name__ == "__main__":  # python -m rlhf.plugins.envs.sandbox 'print(1)' [timeout_s]
    import json

    result = run_code(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read(),
                      timeout_s=float(sys.argv[2]) if len(sys.argv) > 2 else 10.0)
    print(json.dumps(dataclasses.asdict(result), indent=2))
