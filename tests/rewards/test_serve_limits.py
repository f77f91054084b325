"""`rlhf reward serve` under hostile clients (issue 19): bodies too large, too many samples, too
deep, stalled uploads and headers, more uploads or requests than slots; none may block /health or others."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.limits import ServerLimits
from tests.helpers import post_raw

pytestmark = pytest.mark.unit


def health(url: str, timeout: float = 5) -> int:
    with urllib.request.urlopen(url + "/health", timeout=timeout) as response:
        return response.status


def stalled_upload(url: str, declared: int = 1000, sent: bytes = b'{"query": [') -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {declared}\r\n\r\n".encode() + sent)
    return sock


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_body_over_the_limit_is_413(serve):
    url = serve(max_body_mb=0.01)
    status, body = post_raw(url, json.dumps({"query": ["x" * 100] * 200}).encode())
    assert status == 413 and "--max-body-mb" in body["error"]
    assert post_raw(url, b'{"query": ["x"]}') == (200, {"rewards": [1.0], "scores": [1.0]})


def test_too_many_samples_is_400(serve):
    url = serve(max_samples=10)
    status, body = post_raw(url, json.dumps({"query": ["a"] * 11}).encode())
    assert status == 400 and "11 samples" in body["error"] and "--max-samples" in body["error"]


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deep_json_is_400_not_a_recursion_error(serve, depth):
    url = serve(max_depth=64)
    data = b'{"query": ["x"], "labels": [' + b"[" * depth + b"]" * depth + b"]}"
    status, body = post_raw(url, data)
    assert status == 400 and "nested deeper than 64" in body["error"], body


def test_stalled_body_times_out_with_408(serve):
    url = serve(read_timeout_s=0.5)
    sock = stalled_upload(url)
    answer = read_all(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_stalled_headers_are_disconnected(serve):
    url = serve(read_timeout_s=0.5)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\n")  # never finishes the head
    started = time.monotonic()
    assert read_all(sock) == b""  # the server hung up (before the socket's own 10 s timeout)
    assert time.monotonic() - started < 9
    sock.close()


def test_more_uploads_than_upload_slots_get_503_and_health_stays_up(serve):
    url = serve(max_uploads=2, read_timeout_s=30, min_upload_kib_s=0.001)
    stalled = [stalled_upload(url) for _ in range(2)]
    try:
        time.sleep(0.3)  # both admitted and waiting for their bodies
        status, body = post_raw(url, b'{"query": ["x"]}')
        assert status == 503 and "busy" in body["error"] and "--max-uploads" in body["error"]
        assert health(url) == 200
    finally:
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + 10
    while post_raw(url, b'{"query": ["x"]}')[0] == 503 and time.monotonic() < deadline:
        time.sleep(0.05)  # the slots free as the server notices the closed uploads
    assert post_raw(url, b'{"query": ["x"]}') == (200, {"rewards": [1.0], "scores": [1.0]})


def test_more_requests_than_scoring_slots_get_503(serve):
    release = threading.Event()
    source = FunctionSource(lambda completions: release.wait(30) and [1.0] * len(completions), "slow", "slow")
    url = serve(source=source, max_concurrency=1)
    first: list[Any] = []
    thread = threading.Thread(target=lambda: first.append(post_raw(url, b'{"query": ["x"]}', timeout=30)))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())["status"] == "ok":
            assert time.monotonic() < deadline, "the first request never started scoring"
            time.sleep(0.02)
        status, body = post_raw(url, b'{"query": ["y"]}')
        assert status == 503 and "--max-concurrency" in body["error"]
    finally:
        release.set()
        thread.join(30)
    assert first == [(200, {"rewards": [1.0], "scores": [1.0]})]


def test_limits_reject_nonsense():
    with pytest.raises(ValueError, match="max_concurrency"):
        ServerLimits(max_concurrency=0)


def test_a_20_mib_body_of_short_strings_is_refused_by_default(serve):
    url = serve()
    data = json.dumps({"query": ["ab"] * (20 * 2 ** 20 // 6)}).encode()  # ~3.5M samples, ~20 MiB
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(post_raw(url, data, timeout=60)))
    thread.start()
    assert health(url, timeout=30) == 200  # answered while the big body is handled
    thread.join(60)
    status, body = results[0]
    assert status == 400 and "--max-samples" in body["error"]
