"""Load test of `rlhf reward serve` on loopback: normal, trickling and oversized clients at once.

Starts the real command on a toy reward (default limits), first sends 4 concurrent 32 MiB bodies of
``{}`` under an unused key and reads the server's peak RSS, then for ``--minutes`` runs normal
clients (32-sample batches), clients that trickle a byte a second (reconnecting when cut off) and
oversized clients (announced over the limit, or chunked past it). Prints the normal clients'
latency percentiles and the server's RSS over time. Goals: p99 under 1 s, RSS flat.

    python benchmarks/reward_server_load.py --minutes 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOY_REWARD = "def reward_func(queries):\n    return [float(len(q) % 7) for q in queries]\n"
HEAD = "POST /get_reward HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"


def memory_mib(pid: int, field: str) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1)) / 1024


def start_server(workdir: Path) -> tuple[subprocess.Popen, str]:
    (workdir / "toy_reward.py").write_text(TOY_REWARD)
    process = subprocess.Popen([sys.executable, "-m", "rlhf", "reward", "serve", str(workdir / "toy_reward.py"),
                                "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    match = re.search(r" on (http://\S+) ", process.stdout.readline())
    if match is None:
        process.kill()
        raise SystemExit(f"the server did not start: {process.communicate()[1]}")
    return process, match.group(1)


def connect(address: tuple[str, int], timeout: float = 60) -> socket.socket:
    return socket.create_connection(address, timeout=timeout)


def status_of(sock: socket.socket) -> str:
    try:
        head = sock.recv(64)
    except OSError:
        return "reset"
    return head[9:12].decode(errors="replace") if head.startswith(b"HTTP/") else "closed"


def four_max_size_bodies(address: tuple[str, int], pid: int) -> None:
    body = b'{"query": ["x"], "unused": [' + b"{}," * ((32 * 2**20 - 40) // 3) + b"{}]}"
    answers: list[str] = []

    def send() -> None:
        with connect(address, timeout=300) as sock:
            sock.sendall(f"{HEAD}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            answers.append(status_of(sock))

    started = time.monotonic()
    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"4 concurrent {len(body) / 2**20:.1f} MiB bodies of {{}}: answers {sorted(answers)} in "
          f"{time.monotonic() - started:.1f} s; server peak RSS (VmHWM) {memory_mib(pid, 'VmHWM'):.0f} MiB")


class Load:
    def __init__(self, url: str, address: tuple[str, int]):
        self.url, self.address = url, address
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.normal_errors: dict[str, int] = {}
        self.slow_answers: dict[str, int] = {}
        self.oversized_answers: dict[str, int] = {}
        self.lock = threading.Lock()

    def count(self, table: dict[str, int], key: str) -> None:
        with self.lock:
            table[key] = table.get(key, 0) + 1

    def normal(self, seed: int) -> None:
        body = json.dumps({"query": [f"prompt {seed} {i} answer {i * 7}" for i in range(32)],
                           "prompts": [f"prompt {seed} {i} " for i in range(32)],
                           "labels": [str(i) for i in range(32)]}).encode()
        while not self.stop.is_set():
            request = urllib.request.Request(self.url + "/get_reward", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            started = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    response.read()
                with self.lock:
                    self.latencies.append(time.monotonic() - started)
            except urllib.error.HTTPError as exc:
                self.count(self.normal_errors, str(exc.code))
            except OSError as exc:
                self.count(self.normal_errors, type(exc).__name__)
            self.stop.wait(0.05)

    def slow(self) -> None:
        """A byte a second into a body announced as 1 MB, reconnecting when the server cuts it off."""
        while not self.stop.is_set():
            try:
                with connect(self.address) as sock:
                    sock.sendall(f"{HEAD}Content-Length: 1000000\r\n\r\n{{".encode())
                    sock.settimeout(1.0)
                    while not self.stop.is_set():
                        try:
                            head = sock.recv(64)
                        except socket.timeout:
                            sock.sendall(b" ")
                            continue
                        self.count(self.slow_answers, head[9:12].decode(errors="replace") if head else "closed")
                        break
            except OSError as exc:
                self.count(self.slow_answers, type(exc).__name__)

    def oversized(self, chunked: bool) -> None:
        while not self.stop.is_set():
            try:
                with connect(self.address) as sock:
                    if chunked:  # no Content-Length: refused as it grows past 32 MiB
                        sock.sendall(f"{HEAD}Transfer-Encoding: chunked\r\n\r\n".encode())
                        chunk = b"%x\r\n%s\r\n" % (2**20, b" " * 2**20)
                        for _ in range(40):
                            sock.sendall(chunk)
                    else:
                        sock.sendall(f"{HEAD}Content-Length: {64 * 2**20}\r\n\r\n{{".encode())
                    self.count(self.oversized_answers, status_of(sock))
            except OSError as exc:
                self.count(self.oversized_answers, type(exc).__name__)
            self.stop.wait(5.0 if chunked else 0.2)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1] if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the mixed load (default 10)")
    parser.add_argument("--normal", type=int, default=4, help="normal clients")
    parser.add_argument("--slow", type=int, default=20, help="trickling clients")
    parser.add_argument("--oversized", type=int, default=2, help="oversized clients (half of them chunked)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS lines")
    args = parser.parse_args()
    print(f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"Python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_server(Path(tmp))
        try:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            address = (host, int(port))
            print(f"server {url} pid {process.pid}, idle RSS {memory_mib(process.pid, 'VmRSS'):.0f} MiB")
            four_max_size_bodies(address, process.pid)
            run_load(Load(url, address), args, process.pid)
        finally:
            process.terminate()
            process.communicate(timeout=30)


def run_load(load: Load, args: argparse.Namespace, pid: int) -> None:
    threads = [threading.Thread(target=load.normal, args=(i,), daemon=True) for i in range(args.normal)]
    threads += [threading.Thread(target=load.slow, daemon=True) for _ in range(args.slow)]
    threads += [threading.Thread(target=load.oversized, args=(i % 2 == 1,), daemon=True)
                for i in range(args.oversized)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    end = started + args.minutes * 60
    rss: list[float] = []
    print(f"{'t (s)':>6} {'RSS MiB':>8} {'normal ok':>9} {'p50 ms':>7} {'p99 ms':>7}")
    while time.monotonic() < end:
        time.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
        rss.append(memory_mib(pid, "VmRSS"))
        with load.lock:
            latencies = list(load.latencies)
        print(f"{time.monotonic() - started:6.0f} {rss[-1]:8.0f} {len(latencies):9d} "
              f"{percentile(latencies, 0.5) * 1000:7.1f} {percentile(latencies, 0.99) * 1000:7.1f}", flush=True)
    load.stop.set()
    for thread in threads:
        thread.join(60)
    latencies = load.latencies
    print(f"normal clients: {len(latencies)} answered 200, errors {load.normal_errors or 'none'}; latency p50 "
          f"{percentile(latencies, 0.5) * 1000:.1f} ms, p99 {percentile(latencies, 0.99) * 1000:.1f} ms, max "
          f"{max(latencies, default=0) * 1000:.1f} ms")
    print(f"slow clients' answers: {load.slow_answers}; oversized clients' answers: {load.oversized_answers}")
    print(f"server RSS over the load: min {min(rss):.0f}, max {max(rss):.0f}, last {rss[-1]:.0f} MiB; "
          f"peak (VmHWM) {memory_mib(pid, 'VmHWM'):.0f} MiB")


if __name__ == "__main__":
    main()
