"""Synchronous vs ``--async`` `rlhf train` where async should pay: wall seconds per step per case.

Three cases on the README's quickstart (the shipped tiny model, two-number addition, exact match;
G = 16 prompts x n = 8 samples, 16 new tokens):

* ``plain``: no added latency (generation and training compete for the same cores);
* ``slow_reward``: the reward sleeps 0.4 s per call (one batched call per step: a remote verifier),
  with ``--reward-sync-in-thread`` so that the calls of several batches can be in flight;
* ``slow_tools``: a multi-turn environment whose every tool call sleeps 0.2-1.0 s (drawn per
  sample from a fixed seed), stepped concurrently within a turn;
* ``long_tail`` (not in the default ``--cases``): a multi-turn environment with a heavy tail, the
  issue's partial-rollouts case: each trajectory takes 1-10 model turns of 8 tokens (so responses
  vary 10x in length: the benchmarks' random tiny model, which never writes EOS, on their "Say
  many a's" prompts), each turn followed by a tool call that sleeps 0.1 s, or 3 s one time in ten
  (turns and delays drawn from a seed of the prompt and its sample, so every mode sees the same);
  the env scores the share of the letter a in the model's turns (0-1), lr 3e-3. G = 8 prompts x
  n = 8 samples. Its modes are synchronous, ``--async --max-staleness 1``,
  ``--async --max-staleness 2``, ``--async --max-staleness 2 --partial-rollouts`` (the default
  ``--partial-chunk-tokens 8``, and 32 and 64: fewer, later moves to newer weights), and, for scale,
  ``--async --max-staleness 3``. ``--modes`` runs some of a case's modes only.

Each case runs synchronously, with ``--async --max-staleness 1`` and with ``--max-staleness 2``;
every run in a process of its own, runs alternating (case by case, mode by mode, round by round) so
machine load hits all alike, the first step of each run dropped. The table gives wall s/step (what
the user waits: tool calls are sleeps; the mean over every round's steady steps, as K lanes make
steps come in bursts, and the median), CPU s/step of the process (robust to other processes'
load), their spread (min-max over the steady steps) and the ratio to the synchronous step time
(< 1: async is faster); ``--json`` saves it.

``--curves`` instead records the quickstart's reward per step at K = 0, 1, 2 (``--curve-steps``
steps each, plain case) into JSON and a PNG: what staleness costs in learning; with ``--cases
long_tail`` the long-tail case's three modes, run at the same time (a process each: their reward
per step, and side-by-side step times under the same load).

    python benchmarks/async_vs_sync.py [--threads 1] [--rounds 2] [--steps 8] [--json out.json]
    python benchmarks/async_vs_sync.py --cases long_tail [--rounds 2] [--steps 8]
    python benchmarks/async_vs_sync.py --curves [--curve-steps 50] [--png benchmarks/async_curves.png]
    python benchmarks/async_vs_sync.py --curves --cases long_tail [--png benchmarks/long_tail_curves.png]
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
CASES = ("plain", "slow_reward", "slow_tools", "long_tail")
DEFAULT_CASES = ("plain", "slow_reward", "slow_tools")
MODES = {"sync": None, "K=1": 1, "K=2": 2}
# mode -> (--max-staleness or None for the synchronous run, --partial-chunk-tokens with
# --partial-rollouts or 0 without)
MODES_OF = {case: {mode: (k, 0) for mode, k in MODES.items()} for case in DEFAULT_CASES}
MODES_OF["long_tail"] = {"sync": (None, 0), "K=1": (1, 0), "K=2": (2, 0), "K=2 partial": (2, 8),
                         "K=2 partial C=32": (2, 32), "K=2 partial C=64": (2, 64), "K=3": (3, 0)}
CURVE_MODES = ("sync", "K=2", "K=2 partial")  # the long-tail curves: the three modes

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

LONG_TAIL = '''
import random, threading, time, zlib
from rlhf.core.types import StepResult


class LongTailEnv:
    """1-10 model turns per trajectory; every turn is followed by a tool call of 0.1 s, or 3 s one
    time in ten. Turns and delays come from a seed of the prompt and the sample (the how-manieth
    reset of that prompt), so every mode of the benchmark sees the same ones. Scores the share of
    the letter a in the model's turns (averaged over the turns: 0 to 1)."""

    lock = threading.Lock()
    resets = {}

    def reset(self, prompt, label):
        with LongTailEnv.lock:
            sample = LongTailEnv.resets.get(prompt, 0)
            LongTailEnv.resets[prompt] = sample + 1
        self.rng = random.Random(zlib.crc32(f"{prompt}/{sample}".encode()))
        self.turns, self.calls = self.rng.randint(1, 10), 0
        return None

    def step(self, action):
        self.calls += 1
        time.sleep(3.0 if self.rng.random() < 0.1 else 0.1)
        reward = action.count("a") / max(len(action), 1) / self.turns
        return StepResult(observation=" >", reward=reward, done=self.calls >= self.turns)


def no_reward(completions, **kwargs):
    return [0.0] * len(completions)  # the environment scores
'''


def child(args: argparse.Namespace) -> None:
    """One run (this process): prints a JSON line with the step intervals and metrics."""
    benchlib.setup_environment(args.threads)
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.rl.local import train

    work, case, staleness = Path(args.work), args.case, args.staleness
    out = work / f"run-{case}-{staleness}{f'-partial{args.partial}' if args.partial else ''}"
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
    if case == "long_tail":  # a random tiny model that never writes EOS: every turn is 8 tokens
        prompts, _ = benchlib.write_task(work)
        values.update(model=str(benchlib.model_dir("tiny", work)), data=[str(prompts)], label_key=None,
                      env=f"{work / 'long_tail.py'}:LongTailEnv", max_turns=10, max_new_tokens=8, prompts_per_step=8,
                      reward=[f"{work / 'long_tail.py'}:no_reward"], lr=args.lr or 3e-3)
    if staleness >= 0:
        values.update(async_rollout=True, max_staleness=staleness, partial_rollouts=bool(args.partial))
        if args.partial:
            values.update(partial_chunk_tokens=args.partial)
    plugins = build_plugin_manager()
    clock = benchlib.StepClock()
    plugins.register(benchlib.step_clock_plugin(clock), name="benchmark_step_clock")
    clock.start()
    train(TrainConfig.from_dict(values), plugins=plugins)
    keep = ("reward/mean", "time/rollout", "time/reward", "time/train", "async/wait_s", "async/idle_s",
            "staleness/mean", "async/staleness_mean", "response/length_mean", "time/version_wait")
    print("RESULT " + json.dumps({"intervals": clock.intervals, "cpu_intervals": clock.cpu_intervals,
                                  "load": os.getloadavg(), "metrics": [
        {k: m[k] for k in keep if k in m} for m in clock.metrics]}), flush=True)


def start_child(args: argparse.Namespace, work: Path, case: str, staleness: int | None, steps: int,
                partial: int = 0) -> subprocess.Popen:
    command = [sys.executable, __file__, "--child", "--work", str(work), "--case", case,
               "--staleness", str(-1 if staleness is None else staleness), "--steps", str(steps),
               "--seed", str(args.seed)] + (["--threads", str(args.threads)] if args.threads else [])
    command += (["--partial", str(partial)] if partial else []) + (["--lr", str(args.lr)] if args.lr else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def child_result(process: subprocess.Popen, label: str) -> dict:
    stdout, stderr = process.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not lines:
        raise SystemExit(f"{label}: the run failed:\n{stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run_child(args: argparse.Namespace, work: Path, case: str, staleness: int | None, steps: int,
              partial: int = 0) -> dict:
    return child_result(start_child(args, work, case, staleness, steps, partial), f"{case} {staleness}")


def write_helpers(work: Path) -> None:
    (work / "slow_reward.py").write_text(SLOW_REWARD.format(rewards=str(ROOT / "examples" / "rewards.py")))
    (work / "slow_tools.py").write_text(SLOW_TOOLS)
    (work / "long_tail.py").write_text(LONG_TAIL)


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def compare(args: argparse.Namespace, work: Path) -> dict:
    runs: dict[str, dict[str, list[dict]]] = {c: {m: [] for m in MODES_OF[c] if not args.modes or m in args.modes}
                                              for c in args.cases}
    for round_index in range(args.rounds):
        for case in args.cases:
            for mode in runs[case]:
                staleness, partial = MODES_OF[case][mode]
                result = run_child(args, work, case, staleness, args.steps, partial)
                runs[case][mode].append(result)
                walls = [x for r in runs[case][mode] for x in benchlib.steady(r["intervals"])]
                print(f"round {round_index + 1} {case:11s} {mode:11s}: {statistics.fmean(walls):.3f} s/step "
                      f"(load {' '.join(f'{x:.1f}' for x in os.getloadavg())})", flush=True)
    table = {case: summary(modes) for case, modes in runs.items()}
    print_table(table)
    return {"cases": table, "runs": runs}  # every run's step intervals and metrics, for a second look


def summary(modes: dict[str, list[dict]]) -> dict:
    """Per mode: the medians over every run's steady steps, their spread, and the ratios to the first mode's."""
    out = {}
    for mode, results in modes.items():
        steady = [m for r in results for m in benchlib.steady(r["metrics"])]
        walls = [x for r in results for x in benchlib.steady(r["intervals"])]
        cpus = [x for r in results for x in benchlib.steady(r.get("cpu_intervals", []))]
        # the mean: with K lanes the steps come in bursts (K batches finish together), so the median of
        # a bimodal series says little; the mean is the throughput (total seconds / steps)
        row = {"s_per_step": statistics.fmean(walls), "median_s_per_step": statistics.median(walls),
               "wall_spread": [min(walls), max(walls)],
               "cpu_s_per_step": statistics.fmean(cpus) if cpus else float("nan"),
               "cpu_spread": [min(cpus), max(cpus)] if cpus else [],
               "steps_measured": len(walls), "runs": len(results),
               "load": [r["load"][0] for r in results if "load" in r]}
        for key, name in (("async/wait_s", "trainer_wait_s"), ("async/idle_s", "producer_idle_s"),
                          ("time/rollout", "rollout_s"), ("staleness/mean", "token_staleness_mean"),
                          ("async/staleness_mean", "batch_staleness_mean"), ("time/version_wait", "version_wait_s"),
                          ("response/length_mean", "response_length")):
            values = [m[key] for m in steady if key in m]
            row[name] = statistics.median(values) if values else 0.0
        out[mode] = row
    first = next(iter(out.values()))
    for row in out.values():
        row["ratio_to_sync"] = row["s_per_step"] / first["s_per_step"]
        row["cpu_ratio_to_sync"] = row["cpu_s_per_step"] / first["cpu_s_per_step"]
    return out


def print_table(table: dict) -> None:
    print()
    print("| case | mode | wall s/step: mean (median; min-max) | CPU s/step: mean (min-max) | wall / sync | CPU / sync "
          "| trainer waited | producer idle | token staleness | steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case, rows in table.items():
        for mode, row in rows.items():
            print(f"| {case} | {mode} | {row['s_per_step']:.2f} ({row['median_s_per_step']:.2f}; "
                  f"{spread(row['wall_spread'])}) | "
                  f"{row['cpu_s_per_step']:.2f} ({spread(row['cpu_spread'])}) | {row['ratio_to_sync']:.2f}x | "
                  f"{row['cpu_ratio_to_sync']:.2f}x | {row['trainer_wait_s']:.2f} s | {row['producer_idle_s']:.2f} s | "
                  f"{row['token_staleness_mean'] or row['batch_staleness_mean']:.2f} | {row['steps_measured']} |")


def curves(args: argparse.Namespace, work: Path) -> dict:
    """The quickstart's reward per step at K = 0 (the synchronous run, bit for bit: tests/runtime/
    test_async.py), K = 1 and K = 2; with the long-tail case its three modes, at the same time."""
    if "long_tail" in args.cases:
        modes = {mode: MODES_OF["long_tail"][mode] for mode in CURVE_MODES}
        processes = {mode: start_child(args, work, "long_tail", staleness, args.curve_steps, partial)
                     for mode, (staleness, partial) in modes.items()}
        results = {mode: child_result(process, f"long_tail {mode}") for mode, process in processes.items()}
        title = "long tail: reward per step (share of a in the model turns)"
    else:
        results = {label: run_child(args, work, "plain", staleness, args.curve_steps)
                   for label, staleness in (("K=0", 0), ("K=1", 1), ("K=2", 2))}
        title = "quickstart: reward per step by staleness"
    rewards = {label: [m["reward/mean"] for m in result["metrics"]] for label, result in results.items()}
    for label, values in rewards.items():
        tail = values[-10:]
        print(f"{label}: mean reward over the last 10 steps {sum(tail) / len(tail):.3f}", flush=True)
    out = {"reward_per_step": rewards}
    if "long_tail" in args.cases:
        out["side_by_side"] = table = {"long_tail": summary({mode: [r] for mode, r in results.items()})}
        out["runs"] = results
        print_table(table)
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
        axes.set_title(title)
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(DEFAULT_CASES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=None, help="only these modes of each case (e.g. sync 'K=2')")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first is dropped)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (0: the default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None, help="the long-tail case's learning rate (3e-3)")
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
    parser.add_argument("--partial", type=int, default=0, help=argparse.SUPPRESS)
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
