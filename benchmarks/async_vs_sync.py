"""Synchronous vs ``--async`` `rlhf train`: wall seconds per step and samples per second, side by side.

Both runs use the same model, task, seeds and step shape; runs alternate (sync, async, sync, ...)
so machine load hits both alike; the first step of each run is dropped. The ratio is
sync s/step / async s/step (> 1: async is faster). Async overlaps the next batch's generation
(and rewards) with this step's training, so the best it can do is max(generate, train) instead
of generate + train per step: 2x when both take the same time, on hardware where they do not
compete for the same cores. Also printed: the mean time the trainer waited for a batch
(``async/wait_s``) and the producer waited for weights (``async/idle_s``).

    python benchmarks/async_vs_sync.py [--model tiny|small|quickstart|DIR] [--max-staleness 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(args, model: Path, data: Path, reward: str, out: Path, *, asynchronous: bool) -> benchlib.StepClock:
    from rlhf.core.plugins import build_plugin_manager
    from rlhf.runtime.config import TrainConfig
    from rlhf.runtime.local import train

    shutil.rmtree(out, ignore_errors=True)
    values = dict(model=str(model), data=[str(data)], reward=[reward], algo="grpo", prompts_per_step=args.prompts,
                  n_samples=args.n, max_new_tokens=args.max_new_tokens, micro_batch_size=args.micro_batch_size,
                  steps=args.steps, lr=args.lr, kl_coef=args.kl_coef, out=str(out), progress=False, seed=args.seed,
                  async_rollout=asynchronous, max_staleness=args.max_staleness)
    if args.model == "quickstart":
        values.update(input_key="prompt", label_key="answer")
    plugins = build_plugin_manager()
    clock = benchlib.StepClock()
    plugins.register(benchlib.step_clock_plugin(clock), name="benchmark_step_clock")
    clock.start()
    train(TrainConfig.from_dict(values), plugins=plugins)
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_step_arguments(parser, rounds=2, other="then async", kl_help="β (0: no reference model)")
    parser.add_argument("--max-staleness", type=int, default=1)
    args = parser.parse_args()
    threads = benchlib.setup_environment(args.threads)
    root = benchlib.work_dir(args.work_dir)
    if args.model == "quickstart":  # the README's quickstart: shipped model, addition task, exact match
        model, data = ROOT / "examples" / "tiny-model", ROOT / "examples" / "data" / "train.jsonl"
        reward = f"{ROOT / 'examples' / 'rewards.py'}:exact_match"
    else:
        model = benchlib.model_dir(args.model, root)
        data, reward_file = benchlib.write_task(root)
        reward = f"{reward_file}:count_a"
    print(benchlib.machine_line(threads))
    print("versions:", benchlib.versions())
    print(f"model {args.model}: G={args.prompts} n={args.n} new tokens={args.max_new_tokens} "
          f"steps={args.steps} K={args.max_staleness}")
    per_mode: dict[str, list[float]] = {"sync": [], "async": []}
    waits, idles = [], []
    for round_index in range(args.rounds):
        for mode in ("sync", "async"):
            clock = run(args, model, data, reward, root / f"run-{mode}", asynchronous=mode == "async")
            steps = benchlib.steady(clock.intervals)
            per_mode[mode] += steps
            if mode == "async":
                waits += [m["async/wait_s"] for m in benchlib.steady(clock.metrics)]
                idles += [m["async/idle_s"] for m in benchlib.steady(clock.metrics)]
            print(f"round {round_index + 1} {mode:5s}: {benchlib.median(steps):.3f} s/step  "
                  f"(load {' '.join(f'{x:.1f}' for x in os.getloadavg())})", flush=True)
    sync, asynchronous = benchlib.median(per_mode["sync"]), benchlib.median(per_mode["async"])
    samples = args.prompts * args.n
    print(f"sync  {sync:.3f} s/step  {samples / sync:.1f} samples/s")
    print(f"async {asynchronous:.3f} s/step  {samples / asynchronous:.1f} samples/s  "
          f"(trainer waited {benchlib.median(waits):.3f} s/step, producer idle {benchlib.median(idles):.3f} s/step)")
    print(f"ratio sync/async: {sync / asynchronous:.2f}x")


if __name__ == "__main__":
    main()
