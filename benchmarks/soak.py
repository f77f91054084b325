"""A long `rlhf train` run sampling its memory: does the resident set grow after warm-up?

Runs the README's quickstart command (GRPO on the tiny model, exact-match reward) for ``--steps``
steps (default 1,500) in its own process, reads its resident set size (``VmRSS`` of
/proc/PID/status, children included) every ``--every-s`` seconds, and reports RSS at the end of
warm-up (``--warmup`` of the steps, default 10%) and at the end, their ratio, the peak, and the
step each sample was taken at (from metrics.jsonl). Pass criterion: growth after warm-up <= 5%.

    python benchmarks/soak.py --steps 1500 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command(steps: int, out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "rlhf", "train", "--algo", "grpo", "--model", str(ROOT / "examples/tiny-model"),
            "--data", str(ROOT / "examples/data/train.jsonl"), "--input-key", "prompt", "--label-key", "answer",
            "--reward", f"{ROOT / 'examples/rewards.py'}:exact_match", "--n-samples", "8", "--prompts-per-step", "16",
            "--max-new-tokens", "16", "--lr", "1e-4", "--steps", str(steps), "--save-every", "100",
            "--no-progress", "--out", str(out), *extra]


def tree_rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` and its descendants, KiB."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
            pending.extend(int(c) for c in children)
        except (OSError, StopIteration, ValueError):
            continue
    return total


def steps_done(out: Path) -> int:
    try:
        return sum(1 for _ in (out / "metrics.jsonl").open())
    except OSError:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every-s", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps counted as warm-up")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--json", type=Path, help="write the samples here")
    options = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="rlhf-soak-")) / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    began = time.monotonic()
    process = subprocess.Popen(command(options.steps, out, ["--threads", options.threads]), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, int, int]] = []  # (seconds, step, RSS KiB)
    while process.poll() is None:
        samples.append((time.monotonic() - began, steps_done(out), tree_rss_kib(process.pid)))
        time.sleep(options.every_s)
    if process.returncode != 0:
        sys.exit(f"the run failed ({process.returncode}): {process.stderr.read()[-2000:]}")
    # training steps only: the final export at the end is not a step
    warm = [s for s in samples if options.warmup * options.steps <= s[1] < options.steps and s[2] > 0]
    if len(warm) < 2:
        sys.exit("too few samples after warm-up: lower --every-s or raise --steps")
    first, last = warm[0], warm[-1]
    peak = max(s[2] for s in warm)
    growth = last[2] / first[2] - 1
    print(f"{options.steps} steps in {samples[-1][0]:.0f} s; {len(samples)} samples every {options.every_s} s")
    print(f"RSS after warm-up (step {first[1]}): {first[2] / 1024:.1f} MiB; at the end (step {last[1]}): "
          f"{last[2] / 1024:.1f} MiB; peak after warm-up {peak / 1024:.1f} MiB; growth {growth:+.2%} "
          f"({'pass' if growth <= 0.05 else 'FAIL'}: <= 5%)")
    for fraction in (0.25, 0.5, 0.75):
        sample = warm[min(len(warm) - 1, int(fraction * len(warm)))]
        print(f"  step {sample[1]:5d}: {sample[2] / 1024:.1f} MiB")
    if options.json:
        options.json.write_text(json.dumps({"samples": samples, "growth": growth}, indent=1))


if __name__ == "__main__":
    main()
