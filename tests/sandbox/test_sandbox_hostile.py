"""Hostile code through the sandbox: each case must be contained, end with a clean status,
leave no process behind (the `marker` fixture checks), and leave this test process, its parent
and an unrelated sibling alive.

Every case runs in three set-ups: ``auto`` (the strongest isolation this machine allows),
``no_namespaces`` (uid drop where possible, plus the Python guard) and ``guard_only`` (no OS
isolation beyond rlimits: only the audit-hook guard). A case that would be fatal if containment
failed (signalling every process) sends signal 0 instead of SIGKILL unless an OS layer (pid
namespace or a separate uid) is reported, so a regression fails the test instead of the run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from rlhf.sandbox import OUTPUT_KILL_FACTOR, run_code

from .conftest import needs_linux

pytestmark = [pytest.mark.unit, needs_linux]


def _world_readable_python() -> str | None:
    """As root, an interpreter a dropped uid can run without namespaces (ours may live in /root)."""
    if os.geteuid() != 0:
        return None
    for candidate in (f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}", "/usr/bin/python3"):
        real = os.path.realpath(candidate)
        if os.path.exists(real) and all(os.stat(p).st_mode & 0o001 for p in Path(real).parents):
            return candidate
    return None


MODES = {
    "auto": {},
    "no_namespaces": {"namespaces": False, **({"python": p} if (p := _world_readable_python()) else {})},
    "guard_only": {"namespaces": False, "drop_privileges": False, "python_guard": True},
}


@pytest.fixture(params=sorted(MODES))
def mode(request) -> dict:
    return MODES[request.param]


def run(code: str, mode: dict, marker: str, **limits):
    limits.setdefault("timeout_s", 5)
    return run_code(textwrap.dedent(code), env={"RLHF_TEST_MARKER": marker}, **mode, **limits)


def test_infinite_loop_times_out(mode, marker):
    result = run("while True:\n    pass\n", mode, marker, timeout_s=1)
    assert result.status == "timeout", result
    assert "timeout" in result.message


def test_fork_bomb_is_contained(mode, marker):
    code = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    result = run(code, mode, marker, timeout_s=1, max_processes=16)
    assert result.status == "timeout", result


@pytest.mark.parametrize("code", ["x = bytearray(64 * 1024 ** 3)\n",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n"])
def test_memory_bomb_fails_with_memory_error(mode, marker, code):
    result = run(code, mode, marker, memory_mb=256, timeout_s=20)
    assert result.status == "error", result
    assert "MemoryError" in result.stderr and "memory limit 256 MiB" in result.message


def test_huge_output_is_capped_and_killed(mode, marker):
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", mode, marker, max_output_bytes=4096)
    assert result.status == "killed", result
    assert f"more than {OUTPUT_KILL_FACTOR * 4096} bytes" in result.message
    assert result.stdout == "x" * 4096 and result.stdout_truncated


def test_writing_outside_the_working_directory_leaves_no_file(mode, marker, tmp_path):
    shared = Path(tempfile.mkdtemp(prefix="rlhf-world-writable-"))
    shared.chmod(0o777)
    name = f"escape-{uuid.uuid4().hex}"
    targets = [tmp_path / name, shared / name, Path(tempfile.gettempdir()) / name, Path("/var/tmp") / name,
               Path("/dev/shm") / name]
    code = f"""
        import os
        for path in {[str(t) for t in targets] + ["../" + name]!r}:
            try:
                with open(path, "w") as f:
                    f.write("pwned")
                print("wrote", path)
            except OSError as exc:
                print("refused", path, type(exc).__name__)
        with open("inside.txt", "w") as f:
            f.write("fine")
        print("inside ok")
    """
    try:
        result = run(code, mode, marker)
        assert result.status == "ok", result
        assert "inside ok" in result.stdout
        leaked = [str(t) for t in targets if t.exists()]
        assert leaked == [], f"the code wrote outside its directory: {leaked}\n{result.stdout}"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        for t in targets:
            if t.exists():
                t.unlink()


def test_environment_secrets_are_not_readable(mode, marker, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLHF_TEST_SECRET", secret)
    code = f"""
        import os
        print(dict(os.environ))
        for pid in [os.getppid(), {os.getpid()}, 1] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            try:
                with open(f"/proc/{{pid}}/environ", "rb") as f:
                    print(pid, f.read())
            except OSError:
                pass
    """
    result = run(code, mode, marker)
    assert result.status == "ok", result
    assert secret not in result.stdout + result.stderr
    assert "RLHF_TEST_MARKER" in result.stdout  # what we passed on purpose does arrive


def test_network_is_unreachable(mode, marker):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"""
            import socket
            for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
                try:
                    socket.create_connection(address, timeout=1).close()
                    print("connected", address)
                except OSError as exc:
                    print("blocked", address, type(exc).__name__)
        """
        result = run(code, mode, marker)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody ever connected
    assert result.status == "ok", result
    assert "connected" not in result.stdout and result.stdout.count("blocked") == 2


def test_killing_the_parent_and_everyone_else_fails(mode, marker):
    layers = run_code("pass", **mode).isolation
    sig = signal.SIGKILL if {"pid_ns", "uid"} & set(layers) else 0  # 0 probes without harm
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    parent = os.getppid()
    code = f"""
        import os
        for pid in [os.getppid(), {os.getpid()}, {parent}, {sibling.pid}, -1]:
            try:
                os.kill(pid, {int(sig)})
                print("signalled", pid)
            except (OSError, PermissionError) as exc:
                print("refused", pid, type(exc).__name__)
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid():
                try:
                    os.kill(int(name), {int(sig)})
                except OSError:
                    pass
        print("still here")
    """
    try:
        result = run(code, mode, marker)
        os.kill(parent, 0)  # raises if our parent was killed
        assert sibling.poll() is None, "an unrelated process was killed"
        assert result.status == "ok", result
        for pid in (os.getpid(), parent, sibling.pid):
            assert f"signalled {pid}\n" not in result.stdout, result.stdout
    finally:
        sibling.kill()
        sibling.wait()


def test_background_children_are_cleaned_up(mode, marker):
    code = """
        import os, subprocess, sys, time
        if os.fork() == 0:              # a daemon: double fork, new session, no stdio
            os.setsid()
            if os.fork() == 0:
                os.close(1)
                os.close(2)
                time.sleep(60)
            os._exit(0)
        try:
            subprocess.Popen(["sleep", "60"], start_new_session=True)
        except OSError as exc:
            print("no exec:", exc)
        print("main done")
    """
    result = run(code, mode, marker, timeout_s=10)
    if "fork" in ",".join(result.isolation):  # the guard refuses forks where nproc cannot be enforced
        assert result.status == "error" and "os.fork is not allowed" in result.stderr, result
    else:
        assert result.status == "ok" and "main done" in result.stdout, result  # not "timeout": no waiting
