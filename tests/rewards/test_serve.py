"""`rlhf reward serve`: any reward source over OpenRLHF's protocol, checked with our own client and
with raw HTTP requests, in-process and as the real command in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.options import RewardOptions
from rlhf.rewards import RewardError, load_reward, load_rewards
from tests.helpers import run_cli

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def post(url: str, body: Any, token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "length": float(len(solution_str))}


def test_served_function_through_our_client(serve, plugins):
    url = serve(FunctionSource(compute_score, "verl", "verl"))
    result = load_rewards([url + "/get_reward"], plugins=plugins).score(
        ["Q1: ", "Q2: "], [" 42", "41"], ["42", "42"])
    assert result.total == [1.0, 0.0]
    assert result.metrics["reward/127.0.0.1/length"] == 2.5


def test_raw_protocol_and_health(serve):
    calls = []

    def openrlhf_style(queries, prompts, labels):
        calls.append((queries, prompts, labels))
        return {"rewards": [1.0, None], "extra_logs": {"k": [3.0, 5.0]}}

    url = serve(FunctionSource(openrlhf_style, "o", "o"))
    status, body = post(url + "/anything", {"query": ["p1 c1", "zz"], "prompts": ["p1 ", "p2 "], "labels": ["a", 1]})
    assert status == 200
    assert body == {"rewards": [1.0, None], "scores": [1.0, None], "extra_logs": {"k": [3.0, 5.0]}}
    assert calls == [(["p1 c1", "p2 zz"], ["p1 ", "p2 "], ["a", 1])]  # query re-built from prompt + completion
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok", "reward": "o"}


def test_a_batch_leaves_the_running_ones_before_its_answer_goes_out():
    """The scoring thread takes a batch off /health's running batches before it hands the event loop
    the result (or the error) that the response is made of, so a /health right after a response
    says ok, never busy."""
    import concurrent.futures

    from rlhf.rewards.server import RewardServer
    from rlhf.rewards.source import RewardBatch

    def flaky(completions):
        if completions == ["bad"]:
            raise ValueError("no")
        return [1.0] * len(completions)

    server = RewardServer(FunctionSource(flaky, "f", "f"), host="127.0.0.1", port=0)
    health_at_answer = []
    for completion in ("good", "bad"):
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.add_done_callback(lambda _: health_at_answer.append(server.health()))
        server._jobs.put((RewardBatch(prompts=["p"], completions=[completion], labels=[None],
                                      prompt_texts=["p"]), future))
    server._jobs.put(None)
    server.run()
    ok = (200, {"status": "ok", "reward": "f"})
    assert health_at_answer == [ok, ok]  # the answer and the error both found no batch running


def test_bad_requests_get_400(serve):
    url = serve(FunctionSource(lambda completions: [0.0] * len(completions), "z", "z"))
    assert post(url, {"prompts": []})[0] == 400
    status, body = post(url, {"query": ["a", "b"], "prompts": ["a"]})
    assert status == 400 and "as long as" in body["error"]


def test_failures_answer_500_naming_the_function(serve, plugins):
    def broken(completion):
        raise KeyError("gold answer missing")

    url = serve(FunctionSource(broken, "broken", "broken (grader.py:3)"))
    status, body = post(url, {"query": ["x"], "prompts": [""]})
    assert status == 500 and "broken (grader.py:3)" in body["error"] and "gold answer missing" in body["error"]
    client = load_reward(url, plugins=plugins, on_error="zero", retries=0)
    assert client.score(["p"], ["c"]) == [0.0]


def test_server_side_policy_zero(serve):
    def broken(completion):
        raise ValueError("nope")

    url = serve(FunctionSource(broken, "b", "b", RewardOptions(on_error="zero")))
    assert post(url, {"query": ["x", "y"]}) == (200, {"rewards": [0.0, 0.0], "scores": [0.0, 0.0]})


def test_token_required_when_configured(serve):
    url = serve(FunctionSource(lambda completions: [1.0] * len(completions), "t", "t"), token="s3cret")
    assert post(url, {"query": ["x"]})[0] == 401
    assert post(url, {"query": ["x"]}, token="wrong")[0] == 401
    assert post(url, {"query": ["x"]}, token="s3cret") == (200, {"rewards": [1.0], "scores": [1.0]})


def test_sync_functions_run_in_the_serving_thread_and_async_on_the_loop(serve):
    seen = []

    def sync_reward(completions):
        seen.append(threading.current_thread().name)
        return [1.0] * len(completions)

    async def async_reward(completions):
        await asyncio.sleep(0)
        seen.append(threading.current_thread().name)
        return [2.0] * len(completions)

    post(serve(FunctionSource(sync_reward, "s", "s")), {"query": ["x"]})
    post(serve(FunctionSource(async_reward, "a", "a")), {"query": ["x"]})
    assert seen[0] != "rlhf-reward-server" and seen[1] == "rlhf-reward-server"


def test_serve_help(plugins):
    result = run_cli(plugins, ["reward", "serve", "--help"])
    assert result.exit_code == 0 and "OpenRLHF" in result.output and "--token-env" in result.output
    for option in ("--allow-no-token", "--max-body-mb", "--max-samples", "--max-depth", "--read-timeout-s",
                   "--max-concurrency", "--max-uploads", "--min-upload-kib-s", "--max-buffered-mb", "--sync-threads",
                   "--stalled-after-s", "--max-connections", "--head-timeout-s", "--max-head-kb"):
        assert option in result.output


def _start_cli(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "rlhf", "reward", "serve", *args], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    match = re.search(r" on (http://\S+) ", line)
    if match is None:
        process.kill()
        raise AssertionError(f"no URL printed: {line!r} {process.communicate()[1]}")
    return process, match.group(1)


@pytest.mark.timeout(120)
def test_real_command_with_token_and_our_client(tmp_path, plugins, monkeypatch):
    (tmp_path / "judge.py").write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    return [float(q[len(p):] == l) for q, p, l in zip(queries, prompts, labels)]\n")
    env = {**os.environ, "RM_TOKEN": "t0ken"}
    process, url = _start_cli([str(tmp_path / "judge.py"), "--port", "0", "--token-env", "RM_TOKEN"], env)
    try:
        monkeypatch.setenv("RM_TOKEN", "t0ken")
        source = load_reward(url, plugins=plugins, token_env="RM_TOKEN")
        assert source.score(["a: ", "b: "], ["yes", "no"], ["yes", "yes"]) == [1.0, 0.0]
        monkeypatch.delenv("RLHF_REWARD_TOKEN", raising=False)
        with pytest.raises(RewardError, match="HTTP 401"):
            load_reward(url, plugins=plugins).score(["a"], ["b"])
    finally:
        process.terminate()
        process.communicate(timeout=30)


@pytest.mark.timeout(120)
def test_real_command_refuses_exposure_without_token_unless_allowed(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RLHF_REWARD_TOKEN"}
    refused = subprocess.run([sys.executable, "-m", "rlhf", "reward", "serve", "exact_match", "--host", "0.0.0.0",
                              "--port", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "refusing to serve on 0.0.0.0 without a token" in refused.stderr
    assert "Traceback" not in refused.stderr
    process, _ = _start_cli(["exact_match", "--host", "0.0.0.0", "--port", "0", "--allow-no-token"], env)
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    assert "Warning: serving on 0.0.0.0 without a token" in stderr


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.timeout(120)
def test_real_command_hostile_client_options(tmp_path):
    (tmp_path / "hangs.py").write_text("import time\n\ndef reward_func(queries):\n    time.sleep(3600)\n")
    bad = subprocess.run([sys.executable, "-m", "rlhf", "reward", "serve", "exact_match", "--max-body-mb", "8",
                          "--max-buffered-mb", "4"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--max-buffered-mb (4) must be at least --max-body-mb (8)" in bad.stderr
    assert "Traceback" not in bad.stderr
    process, url = _start_cli([str(tmp_path / "hangs.py"), "--port", "0", "--sync-in-thread", "--timeout", "0.3",
                               "--sync-threads", "1", "--stalled-after-s", "0.2", "--max-uploads", "1",
                               "--min-upload-kib-s", "0.001", "--max-buffered-mb", "64"], dict(os.environ))
    try:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        upload = socket.create_connection((host, int(port)), timeout=10)
        upload.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        try:
            status, body = _post_expecting_error(url, {"query": ["x"]})
            assert status == 503 and "--max-uploads 1" in body["error"]
        finally:
            upload.close()
        status, body = _post_expecting_error(url, {"query": ["x"]}, retry_503=True)
        assert status == 500 and "no result after 0.3 s" in body["error"]  # the call hangs, its thread stays
        status, body = _post_expecting_error(url, {"query": ["x"]})
        assert status == 503 and "--sync-threads 1" in body["error"]
        status, body = _get(url + "/health")
        assert status == 503 and body["status"] == "stalled" and body["hung_threads"] == 1
    finally:
        process.terminate()
        process.communicate(timeout=30)


def _post_expecting_error(url: str, body: Any, retry_503: bool = False) -> tuple[int, dict[str, Any]]:
    for _ in range(100):
        status, answer = post(url + "/get_reward", body)
        if not (retry_503 and status == 503):
            return status, answer
        time.sleep(0.05)  # the server has yet to notice a closed upload
    return status, answer


@pytest.mark.timeout(120)
def test_the_parse_worker_exits_when_the_server_is_killed(tmp_path):
    (tmp_path / "toy.py").write_text("def reward_func(queries):\n    return [1.0] * len(queries)\n")
    process, url = _start_cli([str(tmp_path / "toy.py"), "--port", "0"], dict(os.environ))
    try:
        body = {"query": ["x" * 1000] * 400}  # over 256 KiB: parsed in the worker process
        assert post(url + "/get_reward", body) == (200, {"rewards": [1.0] * 400, "scores": [1.0] * 400})
        tasks = Path(f"/proc/{process.pid}/task").glob("*/children")
        children = [int(pid) for task in tasks for pid in task.read_text().split()]  # with multiprocessing's
        assert len(children) in (1, 2)  # resource tracker
    finally:
        process.kill()
        process.wait(30)

    def alive(pid: int) -> bool:
        try:
            return bool(Path(f"/proc/{pid}/cmdline").read_bytes())  # empty once a zombie
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children):
        assert time.monotonic() < deadline, "the parse worker outlived its server"
        time.sleep(0.1)
    process.communicate(timeout=30)  # the worker no longer holds the server's stdout open


@pytest.mark.timeout(120)
def test_max_connections_is_lowered_to_fit_the_open_file_limit(tmp_path):
    import resource

    (tmp_path / "toy.py").write_text("def reward_func(queries):\n    return [1.0] * len(queries)\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "rlhf", "reward", "serve", str(tmp_path / "toy.py"), "--port", "0"], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    try:
        assert " on http://" in process.stdout.readline()
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert "at most 192 connections (--max-connections 512)" in stderr and "ulimit -n" in stderr, stderr
