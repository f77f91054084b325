"""One sandboxed execution, host side: start the supervisor (``_sandbox_child.py``), feed it
the request, read its output and status pipe under the timeouts and caps, clean up, and turn
what happened into a `SandboxResult`. Used by ``rlhf.sandbox.run_code``.
Standard library only."""

from __future__ import annotations

import marshal
import math
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import _sandbox_cgroup as _cgroup
from ._sandbox_host import _kill_uid, _python_layout, _signal_message, _warn_missing_layers
from ._sandbox_types import SandboxConfig, SandboxResult

CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
SANDBOX_UIDS = (2_000_000, 2_100_000)  # root: each call runs as a random uid from this range
SETUP_TIMEOUT_S = 10.0  # the supervisor must be ready by then; the code's clock starts after
KILL_GRACE_S = 2.0  # after asking the supervisor to stop, how long until everything is SIGKILLed
OUTPUT_KILL_FACTOR = 8  # a stream this many times over its cap kills the program
CGROUP_OVERHEAD_MB = 64  # the supervisors share the call's cgroup: room for them on top of memory_mb
CGROUP_OVERHEAD_TASKS = 2  # the supervisor and, with namespaces, the pid namespace's init
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1",
}


# --- what every call hides ---------------------------------------------------------------------

_hidden_by_default: tuple[str, ...] = ()


def hide_by_default(paths: Any) -> tuple[str, ...]:
    """Hide ``paths`` (files and directories) from the code of every later call that keeps
    ``SandboxConfig.hide_defaults``: a run registers its data, eval data, run directory, reward
    sources and project checkout, so model code cannot read a label. Replaces what was registered;
    returns the resolved paths (``/`` left out). Each call hides those that exist by then."""
    global _hidden_by_default
    resolved = {os.path.realpath(os.fspath(p)) for p in paths if p}
    _hidden_by_default = tuple(sorted(p for p in resolved if p != "/"))
    return _hidden_by_default


def hidden_by_default() -> tuple[str, ...]:
    return _hidden_by_default


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
        hidden = (*cfg.hide_paths, *(_hidden_by_default if cfg.hide_defaults else ()))
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
            "mask": sorted({os.path.realpath(p) for p in homes if p}),
            "hide": sorted({os.path.realpath(p) for p in hidden if p}),
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
