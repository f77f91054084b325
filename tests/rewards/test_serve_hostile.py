"""`rlhf reward serve` against the faults an independent probe found: trickling uploads, bodies
that parse to far more memory than their size, a non-ASCII token, hung threaded calls and a hung
reward behind a healthy /health; and normal clients served while slow and oversized ones are active."""

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
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.limits import ServerLimits
from rlhf.rewards.server import RewardServer
from tests.helpers import post_raw

pytestmark = pytest.mark.unit


def get_health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def answer_of(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


class Tricklers:
    """Connections that announce a body and send it one byte every ``every_s`` seconds."""

    def __init__(self, url: str, count: int, declared: int = 100_000, every_s: float = 0.5):
        self.sockets = [connect(url) for _ in range(count)]
        for sock in self.sockets:
            sock.sendall(f"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n{{".encode())
        self.cut_off = 0  # connections the server answered or closed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, args=(every_s,), daemon=True)
        self._thread.start()

    def _trickle(self, every_s: float) -> None:
        alive = list(self.sockets)
        while alive and not self._stop.wait(every_s):
            for sock in list(alive):
                try:
                    sock.sendall(b" ")
                except OSError:
                    alive.remove(sock)
                    self.cut_off += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in self.sockets:
            sock.close()


def test_trickling_uploads_take_no_scoring_slot(serve):
    url = serve(max_concurrency=2)
    tricklers = Tricklers(url, 20)
    try:
        time.sleep(0.5)  # all 20 admitted and trickling
        started = time.monotonic()
        assert post_raw(url, b'{"query": ["x"]}') == (200, {"rewards": [1.0], "scores": [1.0]})
        assert time.monotonic() - started < 5  # measured: ~5 ms
    finally:
        tricklers.close()


def test_a_trickling_body_is_cut_off_by_the_minimum_rate(serve):
    url = serve(read_timeout_s=60)
    sock = connect(url)
    sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
    for _ in range(40):  # a byte every 0.1 s, far under 16 KiB/s: answered long before the 60 s read timeout
        try:
            sock.sendall(b" ")
        except OSError:
            break
        time.sleep(0.1)
    answer = answer_of(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"--min-upload-kib-s" in answer, answer[:300]


def test_json_values_are_bounded_wherever_they_are(serve):
    url = serve(max_samples=100)  # 6400 values
    junk = b'{"query": ["x"], "unused": [' + b"{}," * 10_000 + b'{}]}'
    status, body = post_raw(url, junk)
    assert status == 400 and "JSON values" in body["error"] and "--max-samples" in body["error"]
    in_labels = b'{"query": ["x"], "labels": [[' + b"[]," * 10_000 + b'[]]]}'
    assert post_raw(url, in_labels)[0] == 400
    structured = json.dumps({"query": ["x"] * 100, "labels": [{"answer": "1", "cases": [1, 2, 3]}] * 100})
    assert post_raw(url, structured.encode())[0] == 200


def test_bodies_held_at_once_stay_within_max_buffered_mb(serve):
    url = serve(max_body_mb=1, max_buffered_mb=1.5)
    first = connect(url)
    first.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
                  + b'{"query": ["' + b"x" * 900_000)  # held, not finished
    try:
        time.sleep(0.5)
        status, body = post_raw(url, json.dumps({"query": ["y" * 900_000]}).encode())
        assert status == 503 and "--max-buffered-mb" in body["error"]
        assert post_raw(url, b'{"query": ["small"]}')[0] == 200
    finally:
        first.close()


def test_limits_refuse_a_buffer_smaller_than_one_body():
    with pytest.raises(ValueError, match="max_buffered_mb"):
        ServerLimits(max_body_mb=8, max_buffered_mb=4)
    assert ServerLimits(max_body_mb=8).max_buffered_mb == 32


def test_a_non_ascii_authorization_header_is_401(serve):
    source = FunctionSource(lambda completions: [1.0] * len(completions), "t", "t")
    server = RewardServer(source, host="127.0.0.1", port=0, token="s3cret")
    url = server.start()
    try:
        sock = connect(url)
        sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 16\r\n"
                     b"Authorization: Bearer \xc3\xa9t\xe9\xff\r\n\r\n" + b'{"query": ["x"]}')
        answer = answer_of(sock)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
        assert b"Traceback" not in answer and b"bearer token" in answer
    finally:
        server.stop()


def test_hung_threaded_calls_are_bounded_and_then_refused_with_503(serve):
    release = threading.Event()

    def hangs(completions):
        release.wait(60)
        return [1.0] * len(completions)

    source = FunctionSource(hangs, "hangs", "hangs", RewardOptions(sync_in_thread=True, timeout_s=0.2))
    url = serve(source=source, sync_threads=2)
    before = threading.active_count()
    try:
        for _ in range(2):  # each call times out and leaves its thread behind, holding a slot
            status, body = post_raw(url, b'{"query": ["x"]}')
            assert status == 500 and "no result after 0.2 s" in body["error"], body
        for _ in range(3):
            status, body = post_raw(url, b'{"query": ["x"]}')
            assert status == 503 and "--sync-threads 2" in body["error"]
        assert threading.active_count() - before <= 2
        status, health = get_health(url)
        assert status == 503 and health["status"] == "stalled" and health["hung_threads"] == 2
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while get_health(url)[0] != 200:  # the stuck calls return and give their slots back
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert post_raw(url, b'{"query": ["x"]}') == (200, {"rewards": [1.0], "scores": [1.0]})


def test_health_reports_a_hung_reward(serve):
    release = threading.Event()
    source = FunctionSource(lambda completions: release.wait(60) and [1.0] * len(completions), "hang", "hang")
    url = serve(source=source, stalled_after_s=0.5)
    scored: list[Any] = []
    thread = threading.Thread(target=lambda: scored.append(post_raw(url, b'{"query": ["x"]}', timeout=60)))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        seen = set()
        while True:
            status, body = get_health(url)
            seen.add(body["status"])
            if status == 503:
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
        assert "busy" in seen and body["status"] == "stalled" and body["batch_running_s"] >= 0.5
        assert "--stalled-after-s" in body["error"]
    finally:
        release.set()
        thread.join(30)
    assert scored == [(200, {"rewards": [1.0], "scores": [1.0]})]
    assert get_health(url) == (200, {"status": "ok", "reward": "hang"})


def oversized(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    """Announce bodies over the limit, or send chunked ones that grow past it."""
    while not stop.is_set():
        sock = connect(url)
        try:
            if counts["oversized"] % 2:
                sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n{")
            else:
                sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
                chunk = b"x" * 65536
                for _ in range(40):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            answer = answer_of(sock)
            counts[answer[:12].decode(errors="replace")] = counts.get(answer[:12].decode(errors="replace"), 0) + 1
        except OSError:
            counts["reset"] = counts.get("reset", 0) + 1
        finally:
            counts["oversized"] += 1
            sock.close()


@pytest.mark.timeout(60)
def test_normal_requests_succeed_while_slow_and_oversized_clients_are_active(serve):
    url = serve(max_concurrency=4, max_body_mb=1)
    tricklers = Tricklers(url, 12)
    stop = threading.Event()
    counts = {"oversized": 0}
    attackers = [threading.Thread(target=oversized, args=(url, stop, counts), daemon=True) for _ in range(2)]
    for thread in attackers:
        thread.start()
    latencies = []
    try:
        end = time.monotonic() + 3
        while time.monotonic() < end:
            started = time.monotonic()
            assert post_raw(url, b'{"query": ["a", "b"]}') == (200, {"rewards": [1.0, 1.0], "scores": [1.0, 1.0]})
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    finally:
        stop.set()
        for thread in attackers:
            thread.join(10)
        tricklers.close()
    assert counts["oversized"] > 2 and max(latencies) < 5, (counts, max(latencies))
    assert any(key.startswith("HTTP/1.1 413") for key in counts), counts
