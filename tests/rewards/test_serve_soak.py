"""A soak of the real `rlhf reward serve` (issue 55, item 8): slow heads, big unfinished heads, heavy
bodies and normal clients at once for about 15 s. The server's memory, read from /proc by this
process, stays within its budget plus a fixed allowance; /health and normal clients are answered
throughout. Latency bounds are loose (a shared 2-core machine is noisy); the measured p99 figures are
printed, and benchmarks/README.md records them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.run

ROOT = Path(__file__).resolve().parents[2]
LOAD_S = 15.0
BUFFERED_MB = 32
ALLOWANCE_MB = 96  # connections, allocator slack, the parsed batches a raw body's count does not cover
TOY_REWARD = "def reward_func(queries):\n    return [float(len(q) % 7) for q in queries]\n"


def rss_mib(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


def children(pid: int) -> list[int]:
    """Child processes of ``pid``, started by any of its threads."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else max(values, default=0)


class Clients:
    def __init__(self, url: str):
        self.url = url
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))
        self.stop = threading.Event()
        self.health: list[float] = []
        self.normal: list[float] = []
        self.heavy: dict[str, int] = {}
        self.failures: list[str] = []
        self.cut = {"slow": 0, "big": 0}

    def request(self, path: str, body: bytes | None, timeout: float) -> tuple[int | str, float]:
        request = urllib.request.Request(self.url + path, data=body, method="POST" if body else "GET",
                                         headers={"Content-Type": "application/json"})
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
                return response.status, time.monotonic() - started
        except urllib.error.HTTPError as exc:
            return exc.code, time.monotonic() - started
        except urllib.error.URLError as exc:
            return type(exc.reason).__name__, time.monotonic() - started
        except OSError as exc:
            return type(exc).__name__, time.monotonic() - started

    def probe_health(self) -> None:
        while not self.stop.is_set():
            status, took = self.request("/health", None, 10)
            if status == 200:
                self.health.append(took)
            else:
                self.failures.append(f"/health: {status}")
            self.stop.wait(0.05)

    def normal_client(self, seed: int) -> None:
        body = json.dumps({"query": [f"prompt {seed} {i} answer" for i in range(32)]}).encode()
        while not self.stop.is_set():
            status, took = self.request("/get_reward", body, 15)
            if status == 200:
                self.normal.append(took)
            elif status != 503:  # 503 "busy, retry" is an answer
                self.failures.append(f"normal: {status}")
            self.stop.wait(0.05)

    def heavy_client(self, body: bytes) -> None:
        while not self.stop.is_set():
            status, _ = self.request("/get_reward", body, 60)
            self.heavy[str(status)] = self.heavy.get(str(status), 0) + 1

    async def head_client(self, kind: str) -> None:
        big = b"".join(b"X-Pad-%03d: %s\r\n" % (i, b"a" * 8000) for i in range(120))  # ~0.9 MiB, never finished
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(*self.address)
            except OSError:
                await asyncio.sleep(0.2)
                continue
            try:
                writer.write(b"POST /get_reward HTTP/1.1\r\nHost: x\r\n")
                if kind == "big":
                    writer.write(big)
                for i in range(200):
                    await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(1024), 0.5) == b"":
                            break
                    except asyncio.TimeoutError:
                        pass
                    if self.stop.is_set():
                        break
                    writer.write(b"X-%d: y\r\n" % i)
            except OSError:
                pass
            finally:
                self.cut[kind] += not self.stop.is_set()
                writer.close()
            await asyncio.sleep(0.5)

    def heads(self) -> None:
        async def run() -> None:
            tasks = [asyncio.create_task(self.head_client("slow")) for _ in range(150)]
            tasks += [asyncio.create_task(self.head_client("big")) for _ in range(40)]
            while not self.stop.is_set():
                await asyncio.sleep(0.1)
            await asyncio.wait(tasks, timeout=5)
            for task in tasks:
                task.cancel()

        asyncio.run(run())


@pytest.mark.timeout(120)
def test_memory_stays_bounded_and_health_answers_under_hostile_load(tmp_path):
    (tmp_path / "toy.py").write_text(TOY_REWARD)
    server = subprocess.Popen(
        [sys.executable, "-m", "rlhf", "reward", "serve", str(tmp_path / "toy.py"), "--port", "0",
         "--max-body-mb", "8", "--max-buffered-mb", str(BUFFERED_MB), "--max-connections", "200",
         "--max-head-kb", "1024", "--head-timeout-s", "3"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        match = re.search(r" on (http://\S+) ", server.stdout.readline())
        assert match, server.communicate(timeout=30)[1]
        clients = Clients(match.group(1))
        n = 16384  # 7.6 MB, 344,067 JSON values: about 0.15 s of json.loads, which holds the GIL
        heavy = json.dumps({"query": [f"q{i} " + "x" * 60 for i in range(n)],
                            "labels": [[f"label-{j:02d}-abcdefgh" for j in range(20)] for _ in range(n)]}).encode()
        assert clients.request("/get_reward", heavy, 60)[0] == 200  # warm: the parse worker is started
        time.sleep(0.5)
        idle, cpu_before = rss_mib(server.pid), cpu_s(server.pid)
        threads = [threading.Thread(target=clients.probe_health), threading.Thread(target=clients.heads)]
        threads += [threading.Thread(target=clients.normal_client, args=(i,)) for i in range(2)]
        threads += [threading.Thread(target=clients.heavy_client, args=(heavy,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        peak = worker_peak = 0.0
        end = time.monotonic() + LOAD_S
        while time.monotonic() < end:
            time.sleep(0.2)
            peak = max(peak, rss_mib(server.pid))
            worker_peak = max([worker_peak] + [rss_mib(child) for child in children(server.pid)])
        clients.stop.set()
        cpu = cpu_s(server.pid) - cpu_before
        for thread in threads:
            thread.join(60)
        assert server.poll() is None, server.communicate(timeout=30)[1]
    finally:
        server.terminate()
        server.communicate(timeout=30)
    print(f"\nserver CPU {cpu:.1f} s in {LOAD_S:g} s, load {os.getloadavg()[0]:.1f}; RSS idle {idle:.0f} MiB, "
          f"peak {peak:.0f} MiB (budget {BUFFERED_MB} MiB); parse worker peak "
          f"{worker_peak:.0f} MiB; /health n {len(clients.health)} p99 {p99(clients.health) * 1000:.1f} ms max "
          f"{max(clients.health) * 1000:.1f} ms; normal n {len(clients.normal)} p99 {p99(clients.normal) * 1000:.1f} "
          f"ms; heavy answers {clients.heavy}; heads cut {clients.cut}; failures {clients.failures[:5]}")
    assert peak - idle <= BUFFERED_MB + ALLOWANCE_MB, (idle, peak)
    assert clients.failures == []  # every probe and normal request answered (no timeout, no reset)
    assert max(clients.health) < 5.0 and len(clients.health) > LOAD_S  # answered all along
    assert len(clients.normal) > LOAD_S * 2 and p99(clients.normal) < 5.0
    assert clients.heavy.get("200", 0) >= 2 and clients.cut["slow"] > 0 and clients.cut["big"] > 0
