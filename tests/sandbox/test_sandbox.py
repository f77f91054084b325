"""The sandbox's API: statuses, outputs, limits, the environment it gives the code, the layers it
reports (each checked from inside), and the async path."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

import rlhf.sandbox as sandbox
from rlhf.sandbox import SANDBOX_UIDS, SandboxConfig, run_code, run_code_async

from .conftest import needs_linux

pytestmark = [pytest.mark.unit, needs_linux]


def test_ok_run_reports_outputs_and_fields():
    result = run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)\n", timeout_s=5)
    assert (result.status, result.stdout, result.stderr, result.returncode, result.signal) == (
        "ok", "out\n", "err\n", 0, None)
    assert result.ok and result.message == "" and result.duration_s > 0
    assert "rlimits" in result.isolation
    assert not result.stdout_truncated and not result.stderr_truncated


def test_an_exception_is_an_error_with_the_codes_own_traceback():
    result = run_code("x = 1\n1 / 0\n")
    assert result.status == "error" and result.returncode == 1
    assert result.message == "ZeroDivisionError: division by zero"
    assert 'File "<string>", line 2, in <module>' in result.stderr and "1 / 0" in result.stderr
    assert "_sandbox_child" not in result.stderr  # the supervisor's frames are not shown


@pytest.mark.parametrize(("code", "status", "returncode", "stderr"), [
    ("import sys; sys.exit(0)", "ok", 0, ""),
    ("raise SystemExit", "ok", 0, ""),
    ("import sys; sys.exit(3)", "error", 3, ""),
    ("import sys; sys.exit('bye')", "error", 1, "bye\n"),
    ("import os; print('x', flush=True); os._exit(5)", "error", 5, ""),
])
def test_exit_codes_follow_the_interpreter(code, status, returncode, stderr):
    result = run_code(code)
    assert (result.status, result.returncode, result.stderr) == (status, returncode, stderr)


def test_a_syntax_error_is_an_error():
    result = run_code("def (:\n")
    assert result.status == "error" and result.message.startswith("SyntaxError")


def test_death_by_signal_is_killed():
    result = run_code("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert (result.status, result.signal, result.returncode) == ("killed", signal.SIGSEGV, None)
    assert "SIGSEGV" in result.message


def test_cpu_time_limit_kills():
    result = run_code("while True:\n    pass\n", timeout_s=20, cpu_time_s=1)
    assert result.status == "killed" and "CPU time limit (1 s)" in result.message, result


def test_file_size_limit_is_a_clean_error():
    result = run_code("open('big', 'wb').write(b'x' * (2 * 1024 * 1024))\n", max_file_size_mb=1)
    assert result.status == "error" and "File too large" in result.message, result


def test_stdin_and_prelude():
    result = run_code("print(input().upper(), x + 1)\n", stdin="hello\n", prelude="x = 41\nprint('hidden')\n1 / 0\n")
    assert (result.status, result.stdout) == ("ok", "HELLO 42\n")


def test_environment_is_scrubbed_and_the_directory_fresh(monkeypatch):
    monkeypatch.setenv("SHOULD_NOT_LEAK", "1")
    code = "import os, json\nprint(json.dumps([sorted(os.environ), os.environ['HOME'], os.environ['TMPDIR'], os.getcwd(), os.listdir('.')]))\nopen('left.txt', 'w').write('x')\n"
    first = run_code(code, env={"EXTRA": "yes"})
    names, home, tmpdir, cwd, listing = json.loads(first.stdout)
    assert set(names) == {*sandbox.BASE_ENV, "EXTRA", "HOME", "TMPDIR", "PWD"}
    assert home == tmpdir == cwd and listing == []
    second = run_code(code)
    assert json.loads(second.stdout)[4] == []  # nothing from the first call


def test_output_is_decoded_and_capped_per_stream():
    result = run_code("import sys\nprint('héllo ✓')\nsys.stdout.flush()\nsys.stdout.buffer.write(b'\\xff' + b'y' * 5000)\n",
                      max_output_bytes=4096)
    assert result.status == "ok"  # 5 KB is over the cap but under the kill threshold
    head = "héllo ✓\n"  # 11 bytes in UTF-8, then one invalid byte, then the cap's remaining 4084
    assert result.stdout == head + "\ufffd" + "y" * (4096 - len(head.encode()) - 1)
    assert result.stdout_truncated and not result.stderr_truncated


def test_sandbox_errors_are_results_not_exceptions():
    result = run_code("print(1)", python="/nonexistent/python3")
    assert result.status == "sandbox_error" and "nonexistent" in result.message


def test_config_is_validated():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(TypeError):
        run_code("pass", no_such_option=1)
    with pytest.raises(TypeError):
        run_code(b"print(1)")


def test_reported_layers_are_in_force():
    """Each layer the sandbox claims is checked from inside the sandbox."""
    code = """
import json, os
ifaces = [line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]]  # no netlink: seccomp
print(json.dumps({"pid": os.getpid(), "uid": os.getuid(), "ifaces": ifaces,
                  "root_ro": bool(os.statvfs("/").f_flag & os.ST_RDONLY), "procs": [p for p in os.listdir("/proc") if p.isdigit()],
                  "tmp": os.listdir("/tmp")}))
"""
    result = run_code(code)
    seen = json.loads(result.stdout)
    layers = set(result.isolation)
    if "pid_ns" in layers:
        assert seen["pid"] == 2  # init is 1, the code 2
    if "proc" in layers:
        assert sorted(seen["procs"], key=int) == ["1", "2"]
    if "net_ns" in layers:
        assert seen["ifaces"] == ["lo"]
    if "uid" in layers:
        assert SANDBOX_UIDS[0] <= seen["uid"] < SANDBOX_UIDS[1]
    if "readonly_fs" in layers:
        assert seen["root_ro"]
    if "mount_ns" in layers:  # a private /tmp: the work directory, plus a Python install that lives under /tmp
        import site
        import sys

        import rlhf

        install = [sys.prefix, sys.base_prefix, *site.getsitepackages(), os.path.dirname(os.path.dirname(rlhf.__file__))]
        kept = {os.path.relpath(p, "/tmp").split(os.sep)[0] for p in map(os.path.realpath, install)
                if p.startswith("/tmp/")}
        assert "sandbox" in seen["tmp"] and set(seen["tmp"]) <= {"sandbox"} | kept, (seen["tmp"], kept)


def test_async_runs_are_bounded_and_do_not_block_the_loop():
    previous = sandbox._max_concurrency
    sandbox.set_max_concurrency(2)

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        results = await asyncio.gather(*(run_code_async(f"print({i} * 2)") for i in range(4)))
        done.set()
        await task
        return results, ticks

    try:
        results, ticks = asyncio.run(main())
    finally:
        sandbox.set_max_concurrency(previous)
    assert [r.stdout for r in results] == ["0\n", "2\n", "4\n", "6\n"]
    assert ticks > 2  # the loop kept running while the code ran
