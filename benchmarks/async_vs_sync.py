"""Synchronous vs ``--async`` `rlhf train` where async should pay: wall seconds per step per case.

Three cases on the README's quickstart (the shipped tiny model, two-number addition, exact match;
G = 16 prompts x n = 8 samples, 16 new tokens):

* ``plain``: no added latency (generation and training compete for the same cores);
* ``slow_reward``: the reward sleeps 0.4 s per call (one batched call per step: a remote verifier),
  with ``--reward-sync-in-thread`` so that the calls of several batches can be in flight;
* ``slow_tools``: a multi-turn environment whose every tool call sleeps 0.2-1.0 s (drawn per
  sample from a fixed seed), stepped concurrently within a turn.

Each case runs synchronously, with ``--async --max-staleness 1`` and with ``--max-staleness 2``;
every run in a process of its own, runs alternating (case by case, mode by mode, round by round) so
machine load hits all alike, the first step of each run dropped, medians over rounds. The table
gives s/step and the ratio async/sync step time (< 1: async is faster); ``--json`` saves it.

``--curves`` instead records the quickstart's reward per step at K = 0, 1, 2 (``--curve-steps``
steps each, plain case) into JSON and a PNG: what staleness costs in learning.

    python benchmarks/async_vs_sync.py [--threads 1] [--rounds 2] [--steps 8] [--json out.json]
    python benchmarks/async_vs_sync.py --curves [--curve-steps 50] [--png benchmarks/async_curves.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = ("plain", "slow_reward", "slow_tools")
MODES = {"sync": None, "K=1": 1, "K=2": 2}

SLOW_REWARD = '''
import time
from pathlib import Path
import importlib.util

_spec = importlib.util.spec_from_file_location("quickstart_rewards", {rewards!r})
_rewards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_rewards)


def slow_exact_match(completions, labels, **kwargs):
    time.sleep(0.4)  # a remote verifier's round trip
    return _rewards.exact_match(completions, labels)
'''

SLOW_TOOLS = '''
import random, time, zlib
from rlhf.core.types import StepResult


class SlowToolEnv:
    """Every step is a tool call that takes 0.2-1.0 s (seeded per prompt and call)."""

    def reset(self, prompt, label):
        self.rng = random.Random(zlib.crc32(str(prompt).encode()))
        self.calls = 0
        return None

    def step(self, action):
        self.calls += 1
        time.sleep(self.rng.uniform(0.2, 1.0))
        return StepResult(observation=" =", reward=0.0, done=self.calls >= 2)
'''


def child(args: argparse.Namespace) -> None:
    """One run (this process): prints a JSON line with the step intervals and metrics."""
    benchlib.setup_environment(args.threads)
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.rl.local import train

    work, case, staleness = Path(args.work), args.case, args.staleness
    out = work / f"run-{case}-{staleness}"
    shutil.rmtree(out, ignore_errors=True)
    values = dict(model=str(ROOT / "examples" / "tiny-model"), data=[str(ROOT / "examples" / "data" / "train.jsonl")],
                  input_key="prompt", label_key="answer", reward=[f"{ROOT / 'examples' / 'rewards.py'}:exact_match"],
                  algo="grpo", prompts_per_step=16, n_samples=8, max_new_tokens=16, steps=args.steps, lr=1e-4,
                  out=str(out), progress=False, seed=args.seed)
    if args.threads:
        values["threads"] = args.threads
    if case == "slow_reward":
        values.update(reward=[f"{work / 'slow_reward.py'}:slow_exact_match"], reward_sync_in_thread=True)
    if case == "slow_tools":
        values.update(env=f"{work / 'slow_tools.py'}:SlowToolEnv", max_turns=2)
    if staleness >= 0:
        values.update(async_rollout=True, max_staleness=staleness)
    plugins = build_plugin_manager()
    clock = benchlib.StepClock()
    plugins.register(benchlib.step_clock_plugin(clock), name="benchmark_step_clock")
    clock.start()
    train(TrainConfig.from_dict(values), plugins=plugins)
    keep = ("reward/mean", "time/rollout", "time/reward", "time/train", "async/wait_s", "async/idle_s")
    print("RESULT " + json.dumps({"intervals": clock.intervals, "metrics": [
        {k: m[k] for k in keep if k in m} for m in clock.metrics]}), flush=True)


def run_child(args: argparse.Namespace, work: Path, case: str, staleness: int | None, steps: int) -> dict:
    command = [sys.executable, __file__, "--child", "--work", str(work), "--case", case,
               "--staleness", str(-1 if staleness is None else staleness), "--steps", str(steps),
               "--seed", str(args.seed)] + (["--threads", str(args.threads)] if args.threads else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{case} {staleness}: the run failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def write_helpers(work: Path) -> None:
    (work / "slow_reward.py").write_text(SLOW_REWARD.format(rewards=str(ROOT / "examples" / "rewards.py")))
    (work / "slow_tools.py").write_text(SLOW_TOOLS)


def compare(args: argparse.Namespace, work: Path) -> dict:
    steps: dict[str, dict[str, list[float]]] = {c: {m: [] for m in MODES} for c in args.cases}
    waits: dict[str, dict[str, list[float]]] = {c: {m: [] for m in MODES} for c in args.cases}
    for round_index in range(args.rounds):
        for case in args.cases:
            for mode, staleness in MODES.items():
                result = run_child(args, work, case, staleness, args.steps)
                steps[case][mode] += benchlib.steady(result["intervals"])
                waits[case][mode] += [m.get("async/wait_s", 0.0) for m in benchlib.steady(result["metrics"])]
                print(f"round {round_index + 1} {case:11s} {mode:4s}: {benchlib.median(steps[case][mode]):.3f} s/step "
                      f"(load {' '.join(f'{x:.1f}' for x in os.getloadavg())})", flush=True)
    table = {}
    for case in args.cases:
        sync = statistics.median(steps[case]["sync"])
        table[case] = {mode: {"s_per_step": statistics.median(steps[case][mode]),
                              "ratio_to_sync": statistics.median(steps[case][mode]) / sync,
                              "trainer_wait_s": statistics.median(waits[case][mode]) if waits[case][mode] else 0.0,
                              "steps_measured": len(steps[case][mode])} for mode in MODES}
    print()
    print("| case | sync s/step | K=1 s/step | K=2 s/step | K=1 / sync | K=2 / sync |")
    print("|---|---|---|---|---|---|")
    for case, row in table.items():
        print(f"| {case} | {row['sync']['s_per_step']:.3f} | {row['K=1']['s_per_step']:.3f} | "
              f"{row['K=2']['s_per_step']:.3f} | {row['K=1']['ratio_to_sync']:.2f}x | "
              f"{row['K=2']['ratio_to_sync']:.2f}x |")
    return {"cases": table}


def curves(args: argparse.Namespace, work: Path) -> dict:
    """The quickstart's reward per step at K = 0 (the synchronous run, bit for bit: tests/runtime/
    test_async.py), K = 1 and K = 2."""
    rewards = {}
    for label, staleness in (("K=0", 0), ("K=1", 1), ("K=2", 2)):
        result = run_child(args, work, "plain", staleness, args.curve_steps)
        rewards[label] = [m["reward/mean"] for m in result["metrics"]]
        tail = rewards[label][-10:]
        print(f"{label}: mean reward over the last 10 steps {sum(tail) / len(tail):.3f}", flush=True)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(6, 3.5))
        for label, values in rewards.items():
            window = 5
            smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                      for i in range(len(values))]
            axes.plot(range(1, len(values) + 1), smooth, label="K=0 (= sync)" if label == "K=0" else label)
        axes.set_xlabel("step")
        axes.set_ylabel("reward/mean (5-step mean)")
        axes.set_title("quickstart: reward per step by staleness")
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    return {"reward_per_step": rewards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first is dropped)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (0: the default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--json", default=None, help="save the results here")
    parser.add_argument("--curves", action="store_true", help="record the reward curves at K = 0, 1, 2 instead")
    parser.add_argument("--curve-steps", type=int, default=50)
    parser.add_argument("--png", default=None, help="with --curves: draw them here")
    # one run, in its own process (what the parent starts)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--staleness", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    work = benchlib.work_dir(args.work_dir) / "async_vs_sync"
    work.mkdir(parents=True, exist_ok=True)
    write_helpers(work)
    print(benchlib.machine_line(args.threads or 0))
    print("versions:", benchlib.versions())
    began = time.time()
    results = curves(args, work) if args.curves else compare(args, work)
    results.update(threads=args.threads, rounds=args.rounds, steps=args.steps, load_after=os.getloadavg(),
                   seconds=time.time() - began, versions=benchlib.versions())
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
