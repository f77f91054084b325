"""`rlhf reward serve`'s connections (issue 55, item 8): request heads count against --max-buffered-mb,
--max-head-kb, --max-connections shedding idle then slow connections first, the head timeout, and
bodies over 256 KiB parsed in a worker process."""

from __future__ import annotations

import asyncio
import json
import pickle
import socket
import threading
import time

import pytest

from rlhf.rewards import connections
from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.limits import ServerLimits
from rlhf.rewards.request_json import (IN_PROCESS_MAX_BYTES, SLICE_SAMPLES, BadRequest, batch_from_slices,
                                       batch_from_slices_on_loop, parse_batch, parse_batch_in_slices)
from rlhf.rewards.server import RewardServer
from tests.helpers import post_raw

pytestmark = pytest.mark.unit

HEAD_START = b"POST /get_reward HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture
def server():
    """An in-process server whose budget and connections a test can look at: ``server(**limits)``."""
    started: list[RewardServer] = []

    def start(**limits) -> RewardServer:
        source = FunctionSource(lambda completions: [float(len(c)) for c in completions], "lengths", "lengths")
        server = RewardServer(source, host="127.0.0.1", port=0, limits=ServerLimits(**limits))
        server.start()
        threading.Thread(target=server.run, daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def connect(server: RewardServer) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


def padded_head(kib: int) -> bytes:
    """A request head of about ``kib`` KiB, not finished (no blank line)."""
    lines = b"".join(b"X-Pad-%03d: %s\r\n" % (i, b"a" * 1000) for i in range(kib))
    return HEAD_START + lines


def closed_by_server(sock: socket.socket, within_s: float = 5) -> bytes | None:
    """What the server answered before closing, or None if it kept the connection open ``within_s``."""
    sock.settimeout(within_s)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (socket.timeout, TimeoutError):
        return None
    except OSError:
        pass
    return b"".join(chunks)


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_unfinished_heads_are_counted_and_the_oldest_shed_when_the_budget_is_full(server):
    srv = server(max_body_mb=1, max_buffered_mb=1, max_head_kb=200)  # 1 MiB holds 6 heads of 80 KB (x2)
    budget = srv._bodies
    socks = []
    for i in range(8):
        sock = connect(srv)
        sock.sendall(padded_head(80))
        socks.append(sock)
        wait_for(lambda: budget.held > 0)
        time.sleep(0.1)
        assert budget.held <= budget.limit
    try:
        assert budget.held >= 5 * 2 * 80 * 1000  # the newest heads are held and counted, twice their size
        assert closed_by_server(socks[0], 2) == b""  # the oldest were shed to make room
        assert closed_by_server(socks[-1], 0.5) is None  # the newest are still open
        assert post_raw(srv.url, json.dumps({"query": ["abc"]}).encode()) == (200, {"rewards": [3.0],
                                                                                    "scores": [3.0]})
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: budget.held == 0)  # every head given back once its connection closed


def test_a_head_over_max_head_kb_is_431(server):
    srv = server(max_head_kb=16)
    sock = connect(srv)
    try:
        sock.sendall(padded_head(20))
        answer = closed_by_server(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 431") and b"--max-head-kb" in answer, answer[:200]
    assert b"Retry-After" not in answer  # too large is not "busy": retrying the same head will not help
    wait_for(lambda: srv._bodies.held == 0)


def test_a_complete_head_is_counted_until_its_request_is_answered(server):
    release = threading.Event()
    holding: list[int] = []

    def slow(completions):
        holding.append(srv._bodies.held)
        release.wait(10)
        return [1.0] * len(completions)

    srv = RewardServer(FunctionSource(slow, "slow", "slow"), host="127.0.0.1", port=0)
    srv.start()
    threading.Thread(target=srv.run, daemon=True).start()
    try:
        body = b'{"query": ["x"]}'
        sock = connect(srv)
        sock.sendall(HEAD_START + b"X-Big: " + b"b" * 5000 + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: holding)
        assert holding[0] >= 2 * 5000 + len(body)  # head (twice) and body while being scored
    finally:
        release.set()
        sock.close()
        srv.stop()
    wait_for(lambda: srv._bodies.held == 0)


def test_past_max_connections_the_connection_waiting_longest_for_its_head_is_shed(server, monkeypatch):
    monkeypatch.setattr(connections, "FRESH_S", 30.0)  # however slow this machine, `first` stays new at first
    srv = server(max_connections=4)
    pool = srv._connections
    first = connect(srv)  # opened first, sends nothing
    time.sleep(0.05)
    slow = [connect(srv) for _ in range(3)]
    for sock in slow:
        sock.sendall(HEAD_START)  # a head begun, never finished
    time.sleep(0.2)
    try:
        assert post_raw(srv.url, b'{"query": ["ab"]}')[0] == 200
        # a connection opened under a second ago that has sent nothing may be a client about to speak: kept
        assert closed_by_server(slow[0], 2) == b"" and closed_by_server(first, 0.2) is None
        wait_for(lambda: len(pool.connections) == 3)
        monkeypatch.setattr(connections, "FRESH_S", 0.0)  # as if a second had passed
        slow.append(connect(srv))
        slow[-1].sendall(HEAD_START)
        wait_for(lambda: len(pool.connections) == 4)
        assert post_raw(srv.url, b'{"query": ["ab"]}')[0] == 200
        assert closed_by_server(first, 2) == b""  # now it has waited longest for a head
        assert all(closed_by_server(sock, 0.2) is None for sock in slow[1:])
        assert pool.shed_count["slow head"] == 2
    finally:
        for sock in [first, *slow]:
            sock.close()


def test_past_max_connections_an_idle_kept_alive_connection_is_shed_first(server):
    srv = server(max_connections=2)
    slow = connect(srv)
    slow.sendall(HEAD_START)
    time.sleep(0.1)
    kept = connect(srv)  # answered, then kept alive and idle
    body = b'{"query": ["ab"]}'
    kept.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    time.sleep(0.1)
    try:
        assert post_raw(srv.url, body)[0] == 200
        assert closed_by_server(kept, 2) == b"" and closed_by_server(slow, 0.2) is None
        assert srv._connections.shed_count["idle"] == 1
    finally:
        slow.close()
        kept.close()


def test_choosing_whom_to_shed_does_not_look_at_every_connection(server, monkeypatch):
    """At the cap every new connection sheds one: under 1,100 slowloris connections that is over a
    thousand times a second, so the choice must not scan all open connections (it took half the
    event loop's time); the connection shed is still the one waiting longest for its head."""
    srv = server(max_connections=120, head_timeout_s=60, read_timeout_s=60)
    pool = srv._connections
    slow = [connect(srv) for _ in range(120)]
    for sock in slow:
        sock.sendall(HEAD_START)
    wait_for(lambda: len(pool.queues["heading"]) == 120)
    looked = []
    real = connections.Connection.sheddable
    monkeypatch.setattr(connections.Connection, "sheddable", property(lambda c: looked.append(c) or real.fget(c)))
    try:
        extra = connect(srv)
        extra.sendall(HEAD_START)
        assert closed_by_server(slow[0], 5) == b""  # the oldest head is shed
        assert all(closed_by_server(sock, 0.05) is None for sock in slow[1:6])
        assert pool.shed_count["slow head"] == 1
        assert 0 < len(looked) <= 10, len(looked)  # the accept looked at a few connections, not 120
        extra.close()
    finally:
        for sock in slow:
            sock.close()


def test_when_no_connection_can_be_shed_a_new_one_answers_503(server):
    srv = server(max_connections=2, min_upload_kib_s=0.001)
    uploads = [connect(srv) for _ in range(2)]
    for sock in uploads:  # bodies being received: never shed
        sock.sendall(HEAD_START + b"Content-Length: 100\r\n\r\n{")
    time.sleep(0.3)
    try:
        extra = connect(srv)
        answer = closed_by_server(extra)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections 2" in answer, answer[:300]
        assert b"\r\nRetry-After: 1\r\n" in answer.partition(b"\r\n\r\n")[0]
    finally:
        for sock in uploads:
            sock.close()


def test_a_head_sent_slowly_is_closed_after_the_head_timeout(server):
    srv = server(head_timeout_s=0.5, read_timeout_s=30)
    sock = connect(srv)
    sock.sendall(HEAD_START)
    started = time.monotonic()
    try:
        for i in range(100):  # a header line every 0.05 s: never idle, never finished
            try:
                sock.sendall(b"X-%d: y\r\n" % i)
            except OSError:
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - started
    finally:
        sock.close()
    assert 0.4 < elapsed < 5, elapsed  # far under --read-timeout-s


def test_the_open_file_limit_lowers_the_connection_cap():
    from rlhf.rewards.server import connection_cap

    assert connection_cap(10) == 10
    assert connection_cap(10**9) < 10**9


def test_large_bodies_are_parsed_in_the_worker_and_match_the_in_process_parse():
    limits = ServerLimits()
    data = {"query": [f"prompt {i} answer {i}" for i in range(600)], "prompts": [f"prompt {i} " for i in range(600)],
            "labels": [{"answer": i, "tags": ["a", "b"]} for i in range(600)]}
    raw = json.dumps(data).encode()
    slices = parse_batch_in_slices(raw, limits)
    assert len(slices) == -(-600 // SLICE_SAMPLES) > 1 and all(isinstance(s, bytes) for s in slices)
    rebuilt, direct = batch_from_slices(list(slices)), parse_batch(raw, limits)
    assert (rebuilt.prompts, rebuilt.completions, rebuilt.labels) == (direct.prompts, direct.completions, direct.labels)
    on_loop = asyncio.run(batch_from_slices_on_loop(list(slices)))  # what the server does: a slice per loop turn
    assert (on_loop.prompts, on_loop.completions, on_loop.labels) == (direct.prompts, direct.completions, direct.labels)
    assert rebuilt.completions[5] == "answer 5" and rebuilt.labels[7] == {"answer": 7, "tags": ["a", "b"]}
    with pytest.raises(BadRequest, match="nested deeper"):
        parse_batch_in_slices(b'{"query": ["x"], "labels": [' + b"[" * 100 + b"]" * 100 + b"]}", limits)
    assert pickle.loads(pickle.dumps(BadRequest("x"))).args == ("x",)  # travels back from the worker


def test_a_large_body_is_scored_through_the_worker_process(server):
    srv = server()
    n = 2000
    data = {"query": [f"p{i}" + "x" * 150 for i in range(n)], "prompts": [f"p{i}" for i in range(n)]}
    raw = json.dumps(data).encode()
    assert len(raw) > IN_PROCESS_MAX_BYTES
    status, body = post_raw(srv.url, raw, timeout=60)
    assert status == 200 and body["rewards"] == [150.0] * n
    assert srv._parser._executor is not None  # the worker was used
    bad = b'{"query": ["x"], "labels": [' + b"[" * 100 + b"]" * 100 + b'], "pad": "' + b" " * 300_000 + b'"}'
    status, body = post_raw(srv.url, bad, timeout=60)
    assert status == 400 and "nested deeper than 64" in body["error"]


def test_where_no_process_can_start_large_bodies_parse_in_a_thread(server, monkeypatch):
    import concurrent.futures

    def no_processes(*args, **kwargs):
        raise OSError("no semaphores here")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", no_processes)
    srv = server()
    raw = json.dumps({"query": ["x" * 200] * 2000}).encode()
    with pytest.warns(UserWarning, match="cannot start a process to parse large bodies"):
        assert post_raw(srv.url, raw, timeout=60) == (200, {"rewards": [200.0] * 2000, "scores": [200.0] * 2000})
    assert srv._parser._no_worker and srv._parser._executor is None


def test_the_event_loop_serves_others_between_the_slices_of_a_large_batch():
    """The server unpickles a large batch on its event loop one slice per turn: another task runs
    between every two slices (in a thread, the unpickling held the GIL against the loop)."""
    limits = ServerLimits()
    raw = json.dumps({"query": [f"q {i}" for i in range(SLICE_SAMPLES * 5)]}).encode()
    slices = parse_batch_in_slices(raw, limits)

    async def main() -> tuple[int, int]:
        turns = 0
        done = False

        async def other() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other())
        await asyncio.sleep(0)
        batch = await batch_from_slices_on_loop(list(slices))
        done = True
        await ticker
        return turns, len(batch)

    turns, n = asyncio.run(main())
    assert n == SLICE_SAMPLES * 5 and turns >= len(slices) == 5


def test_the_parse_worker_runs_at_a_lower_priority():
    import os

    from rlhf.rewards.request_json import WORKER_NICENESS, BodyParser

    parser = BodyParser(ServerLimits())
    try:
        worker = parser._worker()
        assert worker.submit(os.nice, 0).result(timeout=120) == min(19, os.nice(0) + WORKER_NICENESS)
    finally:
        parser.close()


def test_rlhf_reward_serve_tunes_its_interpreter_for_latency():
    """`tune_interpreter` (the server owns its process): 1 ms switch interval, the started server's
    objects frozen, the oldest generation left to `Collector`, which runs a full collection only once
    no large batch is in memory for `quiet_s`, or after `max_s` whatever the load."""
    import subprocess
    import sys

    code = ("import gc, sys\nfrom rlhf.rewards.server import tune_interpreter\nc = tune_interpreter()\n"
            "print(sys.getswitchinterval(), gc.get_threshold()[1:], gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["0.001", "(2,", "1073741824)", "True"], out

    from rlhf.rewards.server import Collector

    now = [100.0]
    collector = Collector(quiet_s=5, max_s=60, clock=lambda: now[0])
    runs = []
    for t, busy in ((104, False), (106, True), (130, True), (131, False), (134, False), (190, True), (192, True)):
        now[0] = t
        collector.tick(busy=busy)
        runs.append(collector.runs)
    assert runs == [0, 0, 0, 1, 1, 1, 2]  # quiet for 5 s with nothing large in memory; or 60 s since the last
