"""Wall time of `rlhf --help` and `rlhf plugins list` (fresh processes, median of N runs).

Goal: under 1 s each with the CPU extras (ray, deepspeed) installed. Usage:

    python benchmarks/startup.py [--runs 10]
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = (["--help"], ["plugins", "list"], ["plugins", "list", "--all", "--json"])


def time_command(exe: str, args: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([exe, *args], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def baseline(runs: int) -> float:
    """A bare `python -c pass`: the part of the time that is the interpreter, not rlhf."""
    return statistics.median(time_command(sys.executable, ["-c", "pass"], runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    exe = str(Path(sys.executable).with_name("rlhf"))
    installed = {m: importlib.util.find_spec(m) is not None for m in ("torch", "ray", "deepspeed", "vllm")}
    print(f"python {platform.python_version()} on {platform.machine()}, installed: "
          + ", ".join(f"{m}={'yes' if ok else 'no'}" for m, ok in installed.items()))
    python_floor = baseline(args.runs)
    print(f"{'command':40} {'median s':>9} {'min s':>7} {'x python':>9}")
    print(f"{'python -c pass':40} {python_floor:9.3f}")
    for command in COMMANDS:
        times = time_command(exe, command, args.runs)
        median = statistics.median(times)
        print(f"{'rlhf ' + ' '.join(command):40} {median:9.3f} {min(times):7.3f} {median / python_floor:9.1f}")


if __name__ == "__main__":
    main()
