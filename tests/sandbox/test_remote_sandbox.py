"""The SandboxFusion-style client against an in-process HTTP server."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from rlhf.plugins.envs import tir
from rlhf.sandbox import remote as remote_sandbox
from rlhf.sandbox.remote import RemoteSandbox
from rlhf.sandbox import run_code
from rlhf.plugins.envs.tir import TIRConfig, TIREnv

pytestmark = pytest.mark.unit

web = pytest.importorskip("aiohttp.web")

RESPONSES = {
    "print(1)": {"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stdout": "1\n",
                                                     "stderr": "", "execution_time": 0.01}},
    "boom": {"status": "Failed", "run_result": {"status": "Finished", "return_code": 1, "stdout": "",
                                                "stderr": "Traceback ...\nValueError: boom\n"}},
    "slow": {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "return_code": None,
                                                "stdout": "", "stderr": ""}},
    "down": {"status": "SandboxError", "message": "pod died", "run_result": None},
}


async def serve(test, *, fail_first=0):
    """Run ``test(url, requests)`` against a fake /run_code server."""
    requests, failures = [], [fail_first]

    async def run_code(request):
        body = await request.json()
        requests.append(body)
        if failures[0] > 0:
            failures[0] -= 1
            return web.Response(status=503, text="busy")
        code = body["code"].strip().splitlines()[-1]
        return web.json_response(RESPONSES.get(code, RESPONSES["print(1)"]))

    app = web.Application()
    app.router.add_post("/run_code", run_code)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await test(f"http://127.0.0.1:{port}", requests)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("code", "status", "message"), [
    ("print(1)", "ok", ""),
    ("boom", "error", "ValueError: boom"),
    ("slow", "timeout", "wall-clock timeout: still running after 3 s"),
    ("down", "sandbox_error", "remote sandbox error: pod died"),
])
def test_responses_map_to_statuses(code, status, message):
    async def test(url, requests):
        return await RemoteSandbox(url=url).run_code_async(code, timeout_s=3, memory_mb=256), requests

    result, requests = asyncio.run(serve(test))
    assert (result.status, result.message, result.isolation) == (status, message, ("remote",))
    assert requests == [{"code": code, "language": "python", "run_timeout": 3, "compile_timeout": 10,
                         "memory_limit_MB": 256, "stdin": ""}]


def test_server_errors_are_retried(monkeypatch):
    monkeypatch.setattr(remote_sandbox, "RETRY_BASE_S", 0.0)

    async def test(url, requests):
        return await RemoteSandbox(url=url, max_retries=2).run_code_async("print(1)"), len(requests)

    result, attempts = asyncio.run(serve(test, fail_first=2))
    assert (result.status, result.stdout, attempts) == ("ok", "1\n", 3)


def test_an_unreachable_server_is_a_sandbox_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    result = RemoteSandbox(url=f"http://127.0.0.1:{port}", max_retries=0).run_code("print(1)")
    assert result.status == "sandbox_error" and f"127.0.0.1:{port}" in result.message


def test_tir_uses_the_remote_sandbox_and_replays_cells_in_the_code():
    async def test(url, requests):
        env = TIREnv(TIRConfig(sandbox_url=url, persist_state=True))
        env.reset("p", "l")
        first = await env.step("```python\nx = 1\nprint(1)\n```\n")
        await env.step("```python\nprint(1)\n```\n")
        return first, requests

    first, requests = asyncio.run(serve(test))
    assert first.observation == "```output\n1\n```\n"
    assert requests[0]["code"] == "x = 1\nprint(1)\n"
    assert requests[1]["code"] == tir._silenced("x = 1\nprint(1)\n") + "print(1)\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="runs the local sandbox")
def test_the_replayed_prelude_runs_silently_and_keeps_state():
    result = run_code(tir._silenced("x = 6\nprint('hidden')\nraise ValueError\n") + "print(x * 7)\n")
    assert (result.status, result.stdout, result.stderr) == ("ok", "42\n", "")
