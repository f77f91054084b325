"""The README's quickstart under CPU-thread settings, idle and beside busy-loop processes.

Each variant is one ``rlhf train`` process (the quickstart command with fewer steps) started
with its own environment; variants alternate within a round, and a round runs once with no
extra load and once with ``--busy-per-core`` busy-loop processes per core running beside it.
Reported: median seconds per step (``time/step`` from metrics.jsonl, first step dropped) and
the load average at the start and end of each run.

    python benchmarks/threads.py --steps 8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import versions  # noqa: E402

CORES = len(os.sched_getaffinity(0))
ALL = str(CORES)  # torch's default thread count: one per core
# name -> (environment, arguments). GOMP_SPINCOUNT=300000 is what GNU OpenMP does with nothing set.
VARIANTS = {
    "rlhf default": ({}, []),  # half the usable cores, fixed
    "--threads auto": ({}, ["--threads", "auto"]),  # follows the load
    "all threads (torch's default)": ({}, ["--threads", ALL]),
    "old default": ({"GOMP_SPINCOUNT": "300000"}, ["--threads", ALL]),
    "--threads 1": ({}, ["--threads", "1"]),
    "OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", ALL]),
    "all threads, spin 10000": ({"GOMP_SPINCOUNT": "10000"}, ["--threads", ALL]),
    "all threads, spin 1000": ({"GOMP_SPINCOUNT": "1000"}, ["--threads", ALL]),
}


def quickstart(steps: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "rlhf", "train", "--algo", "grpo", "--model", str(ROOT / "examples/tiny-model"),
            "--data", str(ROOT / "examples/data/train.jsonl"), "--input-key", "prompt", "--label-key", "answer",
            "--reward", f"{ROOT / 'examples/rewards.py'}:exact_match", "--n-samples", "8",
            "--prompts-per-step", "16", "--max-new-tokens", "16", "--steps", str(steps), "--lr", "1e-4",
            "--out", str(out)]


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def run_variant(name: str, steps: int, root: Path, index: int) -> tuple[float, float, str]:
    env_extra, args = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(env_extra)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    out = root / f"run{index}"
    before = load()
    subprocess.run(quickstart(steps, out) + args, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [row["time/step"] for row in rows[1:]]
    rewards = statistics.fmean(row["reward/mean"] for row in rows)
    return statistics.median(times), rewards, f"{before}->{load()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--busy-per-core", type=float, default=2, help="busy loops per core (0.5: one per two cores)")
    parser.add_argument("--variants", nargs="*", default=["rlhf default", "--threads auto",
                                                             "all threads (torch's default)", "old default"])
    parser.add_argument("--conditions", nargs="*", default=["idle", "busy"])
    options = parser.parse_args()
    print(f"machine: {CORES} usable cores of {os.cpu_count()}, {versions()}, load {load()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="rlhf-threads-"))
    results: dict[tuple[str, str], list[str]] = {}
    index = 0
    for round_ in range(options.rounds):
        for condition in options.conditions:
            busy = []
            if condition == "busy":
                busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(max(1, round(options.busy_per_core * CORES)))]
                time.sleep(1.0)
            try:
                for name in options.variants:
                    index += 1
                    seconds, reward, loads = run_variant(name, options.steps, root, index)
                    figure = f"{seconds:.3f} s (load {loads}, reward {reward:.3f})"
                    results.setdefault((condition, name), []).append(figure)
                    print(f"round {round_ + 1} {condition:4s} {name:26s} {figure}", flush=True)
            finally:
                for process in busy:
                    process.kill()
                    process.wait()
    print("\nmedian s/step per run (first step dropped):")
    for (condition, name), figures in results.items():
        print(f"  {condition:4s} {name:26s} " + "; ".join(figures))


if __name__ == "__main__":
    main()
