"""The reward server probe's three reproductions (issue 55, item 8), against `rlhf reward serve` on loopback.

``heads``: 600 connections each send about 1 MB of request head (126 headers of 8 KB) and never
finish it; the server's RSS once all were sent, and its peak. ``bodies``: two clients post 23.8 MB
bodies within every limit (16,384 samples, about a million JSON values) back to back while a probe
GETs /health every 20 ms and a normal client posts 32-sample batches; p50/p99/max of both.
``slowloris``: the server runs under ``ulimit -n 1024``; 1,100 connections send a request line and
one header line every 5 s, reconnecting when cut off, while 4 normal clients post with a 5 s timeout;
how many normal requests time out.

    python benchmarks/reward_server_attacks.py                      # all three, this checkout
    python benchmarks/reward_server_attacks.py --checkout /other/checkout --only heads
    python benchmarks/reward_server_attacks.py --only heads --serve-args "--max-head-kb 1024"  # heads bounded
                                                                          # by --max-buffered-mb alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
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


def memory_mib(pid: int, field: str) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1)) / 1024


def tree_rss_mib(pid: int) -> float:
    """RSS of the server and its child processes (a parse pool), MiB."""
    total = memory_mib(pid, "VmRSS")
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        try:
            total += tree_rss_mib(int(child))
        except (OSError, AttributeError):
            pass
    return total


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the server process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(checkout: Path, workdir: Path, nofile: int | None = None, extra: list[str] = ()):
    (workdir / "toy_reward.py").write_text(TOY_REWARD)

    def limit() -> None:
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    env = dict(os.environ, PYTHONPATH=str(checkout))
    process = subprocess.Popen([sys.executable, "-m", "rlhf", "reward", "serve", str(workdir / "toy_reward.py"),
                                "--port", "0", *extra], cwd=checkout, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, preexec_fn=limit)
    match = re.search(r" on (http://\S+) ", process.stdout.readline())
    if match is None:
        process.kill()
        raise SystemExit("the server did not start")
    host, port = match.group(1).removeprefix("http://").rsplit(":", 1)
    return process, match.group(1), (host, int(port))


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


def ms(values: list[float]) -> str:
    return (f"n {len(values)}, p50 {percentile(values, 0.5) * 1000:.1f} ms, p99 {percentile(values, 0.99) * 1000:.1f}"
            f" ms, max {max(values, default=0) * 1000:.1f} ms")


# --- 600 unfinished 1 MB heads ---------------------------------------------------------------------

async def big_heads(address: tuple[str, int], pid: int, count: int) -> None:
    pad = "".join(f"X-Pad-{i:03d}: {'a' * 8170}\r\n" for i in range(126)).encode()
    head = b"POST /get_reward HTTP/1.1\r\nHost: x\r\n" + pad  # never ends with the blank line
    writers, refused = [], 0
    started = time.monotonic()

    async def one() -> None:
        nonlocal refused
        try:
            reader, writer = await asyncio.open_connection(*address)
            writers.append(writer)
            writer.write(head)
            await asyncio.wait_for(writer.drain(), 20)
        except (OSError, asyncio.TimeoutError):
            refused += 1

    await asyncio.gather(*(one() for _ in range(count)))
    await asyncio.sleep(2)
    print(f"heads: {count} connections x {len(head) / 2**20:.2f} MiB of head in {time.monotonic() - started:.1f} s "
          f"({refused} not sent in full): server RSS {tree_rss_mib(pid):.0f} MiB, peak (VmHWM) "
          f"{memory_mib(pid, 'VmHWM'):.0f} MiB", flush=True)
    for writer in writers:
        writer.close()


# --- two 23.8 MB bodies at once ----------------------------------------------------------------------

def heavy_body() -> bytes:
    n = 16384
    return json.dumps({"query": [f"question {i} " + "q" * 170 for i in range(n)],
                       "labels": [[f"label-{j:02d}-abcdefgh" for j in range(60)] for _ in range(n)]}).encode()


def timed_get(url: str, timeout: float) -> float | str:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            response.read()
    except (OSError, urllib.error.URLError) as exc:
        return type(exc).__name__
    return time.monotonic() - started


def timed_post(url: str, body: bytes, timeout: float) -> float | str:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        ANSWERS.setdefault(exc.code, exc.read()[:300])
        return str(exc.code)
    except OSError as exc:
        return type(exc).__name__
    return time.monotonic() - started


ANSWERS: dict[int, bytes] = {}  # the first answer of each error status


def heavy_bodies(url: str, pid: int, seconds: float) -> None:
    body = heavy_body()
    stop = threading.Event()
    heavy, health, normal, errors = [], [], [], {}
    small = json.dumps({"query": [f"prompt {i} answer" for i in range(32)]}).encode()

    def record(table: list[float], result: float | str) -> None:
        if isinstance(result, float):
            table.append(result)
        else:
            errors[result] = errors.get(result, 0) + 1

    def poster() -> None:
        while not stop.is_set():
            record(heavy, timed_post(url + "/get_reward", body, 120))

    def prober() -> None:
        while not stop.is_set():
            record(health, timed_get(url + "/health", 30))
            stop.wait(0.02)

    def normal_client() -> None:
        while not stop.is_set():
            record(normal, timed_post(url + "/get_reward", small, 30))
            stop.wait(0.05)

    threads = [threading.Thread(target=poster) for _ in range(2)]
    threads += [threading.Thread(target=prober), threading.Thread(target=normal_client)]
    for thread in threads:
        thread.start()
    peak = 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.2)
        peak = max(peak, tree_rss_mib(pid))
    stop.set()
    for thread in threads:
        thread.join(150)
    print(f"bodies: 2 clients x {len(body) / 1e6:.1f} MB bodies for {seconds:.0f} s: heavy requests {ms(heavy)}; "
          f"/health {ms(health)}; normal {ms(normal)}; errors {errors or 'none'}; server RSS (with children) "
          f"peak {peak:.0f} MiB", flush=True)


# --- 1,100 slowloris connections under ulimit -n 1024 ------------------------------------------------

async def slowloris(address: tuple[str, int], url: str, count: int, seconds: float) -> None:
    stop = asyncio.Event()
    cut = 0

    async def one() -> None:
        nonlocal cut
        while not stop.is_set():
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), 10)
            except (OSError, asyncio.TimeoutError):
                await asyncio.sleep(1)
                continue
            try:
                writer.write(b"POST /get_reward HTTP/1.1\r\nHost: x\r\n")
                for i in range(1000):
                    await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(1), 5) == b"":
                            break
                    except asyncio.TimeoutError:
                        pass
                    if stop.is_set():
                        break
                    writer.write(f"X-{i}: y\r\n".encode())
            except OSError:
                pass
            finally:
                cut += not stop.is_set()
                writer.close()

    normal: list[float] = []
    errors: dict[str, int] = {}
    small = json.dumps({"query": [f"prompt {i} answer" for i in range(32)]}).encode()

    def normal_client(end: float) -> None:
        while time.monotonic() < end:
            result = timed_post(url + "/get_reward", small, 5)
            if isinstance(result, float):
                normal.append(result)
            else:
                errors[result] = errors.get(result, 0) + 1
            time.sleep(0.05)

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    await asyncio.sleep(3)  # all connected (or waiting in the backlog)
    end = time.monotonic() + seconds
    threads = [threading.Thread(target=normal_client, args=(end,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        await asyncio.sleep(0.2)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    total = len(normal) + sum(errors.values())
    print(f"slowloris: {count} connections, server ulimit -n 1024, {seconds:.0f} s: {sum(errors.values())} of "
          f"{total} normal requests failed {errors or ''}; answered {ms(normal)}; slow connections cut {cut} times",
          flush=True)
    for status, answer in ANSWERS.items():
        print(f"  first {status} answer: {answer!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the rlhf checkout whose server runs")
    parser.add_argument("--only", choices=("heads", "bodies", "slowloris"), action="append")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the bodies and slowloris loads")
    parser.add_argument("--serve-args", default="", help="more `rlhf reward serve` options, e.g. '--max-head-kb 1024'")
    args = parser.parse_args()
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, checkout {args.checkout}", flush=True)
    only = args.only or ["heads", "bodies", "slowloris"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in only:
            nofile = 1024 if name == "slowloris" else None
            process, url, address = start_server(args.checkout, Path(tmp), nofile, args.serve_args.split())
            cpu, started = cpu_s(process.pid), time.monotonic()
            try:
                if name == "heads":
                    asyncio.run(big_heads(address, process.pid, 600))
                elif name == "bodies":
                    heavy_bodies(url, process.pid, args.seconds)
                else:
                    asyncio.run(slowloris(address, url, 1100, args.seconds))
                print(f"  server CPU {cpu_s(process.pid) - cpu:.1f} s in {time.monotonic() - started:.0f} s, load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
            finally:
                process.terminate()
                try:
                    process.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


if __name__ == "__main__":
    main()
