"""The same `rlhf` commands from two installs, alternating: did a change move the step time?

Give it two Python executables, each from an environment with rlhf installed (a second checkout of
an older commit in its own virtualenv, say). Each round starts the same command once per install and
the two runs take turns a step at a time on the same CPU core (each waits in its ``on_step_end``
while the other steps), with one torch thread. This shared machine's speed drifts by tens of per
cent over seconds to minutes, on whole runs alike, so runs one after the other compare badly;
steps taken in turns meet the same drift. Reported per case: each side's median CPU seconds per
step and the median (and quartiles) of the per-step ratios after / before, steps 1 and 2 left out
(warm-up and the fast paths' first-use checks).

    python3 -m venv /tmp/venv-before && /tmp/venv-before/bin/pip install torch==2.13.0
    git worktree add /tmp/before <commit> && /tmp/venv-before/bin/pip install -e /tmp/before
    python benchmarks/before_after.py --before /tmp/venv-before/bin/python --after .venv/bin/python

Cases: GRPO on the quickstart's tiny model and task (``grpo-tiny``), PPO with a critic and a
reference model on the same (``ppo-tiny``), GRPO on benchlib's ``small`` model (``grpo-small``),
``rlhf dpo`` and ``rlhf sft`` on the tiny model with bench_worker.py's mixed-length rows.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import bench_worker  # noqa: E402

TINY = benchlib.ROOT / "examples" / "tiny-model"
RL_TASK = ["--data", str(benchlib.ROOT / "examples" / "data" / "train.jsonl"), "--input-key", "prompt",
           "--label-key", "answer", "--reward", f"{benchlib.ROOT / 'examples' / 'rewards.py'}:exact_match",
           "--n-samples", "8", "--prompts-per-step", "16", "--max-new-tokens", "16", "--lr", "1e-4"]


def cases(root: Path) -> dict[str, list[str]]:
    """Each case's arguments after ``rlhf`` (the step count and ``--out`` are added per run)."""
    sft, pairs = root / "ab-sft.jsonl", root / "ab-pairs.jsonl"
    for path, job in ((sft, "sft"), (pairs, "dpo")):
        path.write_text("".join(json.dumps(row) + "\n" for row in bench_worker.offline_rows(job, 512)))
    offline = ["--batch-size", "32", "--micro-batch-size", "8", "--lr", "1e-4"]
    return {
        "grpo-tiny": ["train", "--algo", "grpo", "--model", str(TINY), *RL_TASK],
        "ppo-tiny": ["train", "--algo", "ppo", "--model", str(TINY), "--kl-coef", "0.01", *RL_TASK],
        "grpo-small": ["train", "--algo", "grpo", "--model", str(benchlib.model_dir("small", root)), *RL_TASK],
        "dpo-tiny": ["dpo", "--model", str(TINY), "--data", str(pairs), *offline],
        "sft-tiny": ["sft", "--model", str(TINY), "--data", str(sft), "--input-key", "prompt",
                     "--output-key", "completion", *offline],
    }


def pin_to_one_core() -> None:
    """Run in the child before exec: both sides on the same core, so they meet the same neighbours."""
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})


def lockstep(pythons: dict[str, str], args: list[str], steps: int, root: Path) -> dict[str, list[float]]:
    """One process per side, taking turns a step at a time; each side's CPU seconds per step (all steps)."""
    env = {**os.environ, "RLHF_THREADS": "1"}
    procs = {}
    for side, python in pythons.items():
        out = root / f"ab-run-{side}"
        shutil.rmtree(out, ignore_errors=True)
        command = [python, __file__, "--child", json.dumps([*args, "--steps", str(steps), "--out", str(out)])]
        with open(root / f"ab-run-{side}.log", "w") as log:  # the child keeps its own copy of the file
            procs[side] = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=log, text=True, preexec_fn=pin_to_one_core)
    cpu: dict[str, list[float]] = {side: [] for side in procs}
    for step in range(steps + 1):  # the last turn lets each side finish its run
        order = list(procs) if step % 2 == 0 else list(reversed(procs))
        for side in order:
            procs[side].stdin.write("go\n")
            procs[side].stdin.flush()
            report = next_report(procs[side], root / f"ab-run-{side}.log")
            if report != "done":
                cpu[side].append(json.loads(report)[1])
    for proc in procs.values():
        if proc.wait() != 0:
            sys.exit(f"a run failed: see the logs in {root}")
    return cpu


def next_report(proc: subprocess.Popen, log: Path) -> str:
    """The child's next ``@@`` line (its other output is the run's own)."""
    for line in proc.stdout:
        if line.startswith("@@"):
            return line[2:].strip()
    sys.exit(f"a run stopped early: see {log}")


def child(args: list[str]) -> None:
    """Run one ``rlhf`` command in this process, one step per ``go`` read from stdin, reporting each
    step's wall and CPU seconds (from its ``go`` to its ``on_step_end``) as an ``@@`` line."""
    import types

    import rlhf
    from rlhf.cli.main import make_cli
    try:
        from rlhf.core.plugin_host.loading import build_plugin_manager
    except ImportError:  # an install from before the plugin host moved (7370b48 and older)
        from rlhf.core.plugins import build_plugin_manager

    started: dict[str, float] = {}

    def wait_for_turn() -> None:
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("the benchmark's parent went away")
        started["wall"], started["cpu"] = time.perf_counter(), time.process_time()

    def on_run_start(run: Any) -> None:
        wait_for_turn()

    def on_step_end(run: Any, step: int, metrics: dict[str, Any]) -> None:
        elapsed = [time.perf_counter() - started["wall"], time.process_time() - started["cpu"]]
        print("@@" + json.dumps(elapsed), flush=True)
        wait_for_turn()

    module = types.ModuleType("benchmark_lockstep")
    module.on_run_start = rlhf.hookimpl(on_run_start)
    module.on_step_end = rlhf.hookimpl(on_step_end)
    plugins = build_plugin_manager()
    plugins.register(module, name="benchmark_lockstep")
    make_cli(plugins)(args=[*args, "--no-progress"], standalone_mode=False)
    print("@@done", flush=True)


def quartiles(values: list[float]) -> str:
    low, _, high = statistics.quantiles(values, n=4)
    return f"{low:.3f}-{high:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a Python executable whose environment has the old rlhf")
    parser.add_argument("--after", default=sys.executable, help="the new one (default: this Python)")
    parser.add_argument("--cases", default="grpo-tiny,ppo-tiny,grpo-small,dpo-tiny,sft-tiny")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first two are not compared)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))

    if not args.before:
        parser.error("--before is required: a Python executable whose environment has the old rlhf")
    root = benchlib.work_dir(args.work_dir)
    every = cases(root)
    chosen = [name.strip() for name in args.cases.split(",")]
    unknown = [name for name in chosen if name not in every]
    if unknown:
        sys.exit(f"unknown case {unknown[0]!r}: choose from {', '.join(every)}")
    print(benchlib.machine_line(1))
    print(f"before: {args.before}\nafter:  {args.after}\n{args.steps} steps x {args.rounds} rounds, one thread")
    print("| case | before CPU s/step | after CPU s/step | after / before (median of per-step ratios) | steps compared |")
    print("|---|---|---|---|---|")
    pythons = {"before": args.before, "after": args.after}
    for name in chosen:
        cpu: dict[str, list[float]] = {"before": [], "after": []}
        ratios: list[float] = []
        for _ in range(args.rounds):
            run = lockstep(pythons, every[name], args.steps, root)
            kept = {side: run[side][2:] for side in run}  # steps 1 and 2: warm-up and first-use checks
            cpu["before"] += kept["before"]
            cpu["after"] += kept["after"]
            ratios += [after / before for before, after in zip(kept["before"], kept["after"])]
        b, a = statistics.median(cpu["before"]), statistics.median(cpu["after"])
        print(f"| {name} | {b:.4f} | {a:.4f} | {statistics.median(ratios):.3f} "
              f"(quartiles {quartiles(ratios)}) | {len(ratios)} |", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    main()
