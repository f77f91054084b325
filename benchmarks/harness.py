"""rlhf against TRL and a plain-torch floor, each side in a process of its own, interleaved.

    python benchmarks/harness.py --trl-python /path/to/trl-venv/bin/python [--jobs grpo-small,dpo,sft,...]
        [--sides rlhf,trl,floor] [--rounds 3] [--steps N] [--cpu-linear torch] [--dtype fp32] [--json out.json]

Every run is one `benchmarks/bench_worker.py` process started with that side's interpreter
(``--rlhf-python``, default this one; ``--trl-python``; the floor runs with rlhf's), with one torch
thread (``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = 1) and the same
glibc mmap threshold (``MALLOC_MMAP_THRESHOLD_``, ``--mmap-threshold``; rlhf keeps a user's setting,
so both sides run the same allocator policy) and the same bound on oneDNN's compiled kernels
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY``, ``--kernel-caches``). Rounds
interleave the sides (round r starts with a different side each time: rlhf, trl, floor / trl,
floor, rlhf / ...), the first step of each run
is dropped, and a side's figure is the median of its remaining steps over all rounds, with the
min-max of the per-round medians. CPU time is user + sys of the training process (every thread,
``getrusage``): with one thread it is the work done, whatever else the machine runs.

The floor process also measures the fp32 training-state floor (libraries, weights, a gradient and
two AdamW moments per trainable parameter; `bench_worker.training_state_floor`): each side's peak
RSS above it is printed, with rlhf's over TRL's. ``--dtype bf16`` loads every side's weights in
bfloat16; a side ``rlhf:checkout=PATH`` runs rlhf from another checkout.

Before a ratio is printed the work is compared: per measured step, samples, generated tokens,
trained samples and trained (loss) tokens as each side counted them (its own metrics and counters
around its loss); where a count differs the ratio is refused ("work differs").
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
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "bench_worker.py"
ROOT = HERE.parent
SIDES = ("rlhf", "trl", "floor")
JOBS = ("grpo-small", "grpo-vocab152k", "dpo", "dpo-packing", "sft", "sft-packing", "grpo")
SETTINGS = ("mmap", "cpu-linear", "checkout")
WORK_KEYS = ("samples", "generated_tokens", "trained_samples", "trained_tokens")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(flag for flag in wanted if f" {flag}" in flags)


def parse_side(spec: str) -> tuple[str, dict[str, str]]:
    """``rlhf`` or a variant ``rlhf:mmap=33554432,cpu-linear=onednn,checkout=/path/to/other/rlhf``: the
    worker's side and its settings. ``checkout``: the rlhf (and floor) sides import rlhf from that
    checkout instead of this one (the same worker code: a before/after of the library alone)."""
    name, _, rest = spec.partition(":")
    if name not in SIDES:
        raise SystemExit(f"unknown side {spec!r}: one of {', '.join(SIDES)}, optionally with "
                         f":{'=...,'.join(SETTINGS)}=...")
    settings = dict(item.split("=", 1) for item in rest.split(",") if item)
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"side {spec!r}: unknown setting {', '.join(sorted(unknown))} ({', '.join(SETTINGS)})")
    if "checkout" in settings and (name == "trl" or not (Path(settings["checkout"]) / "rlhf").is_dir()):
        raise SystemExit(f"side {spec!r}: checkout= takes an rlhf checkout (a folder holding rlhf/) for the rlhf "
                         "or floor side")
    return name, settings


def split_sides(text: str) -> list[str]:
    """``--sides`` as its sides: a comma starts a new side only before a side's name, so a side's
    own settings (``rlhf:cpu-linear=auto,checkout=/old``) stay with it."""
    sides: list[str] = []
    for item in text.split(","):
        if sides and item.partition(":")[0] not in SIDES:
            sides[-1] += "," + item  # another setting of the side before
        else:
            sides.append(item)
    return sides


def side_env(args: argparse.Namespace, spec: str, job: str | None = None) -> dict[str, str]:
    side, settings = parse_side(spec)
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    threshold = settings.get("mmap", args.mmap_threshold)
    if threshold == "rlhf":  # what rlhf's prologue picks for the job's model (bench_worker.py prepare)
        threshold = json.loads((args.work_dir / "heap.json").read_text()).get(job) if job else None
        threshold = "default" if threshold is None else threshold
    if threshold != "default":
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    capacity = args.kernel_caches
    if capacity == "rlhf":  # the bound rlhf's run prologue sets (bench_worker.py prepare), given to every side
        chosen = args.work_dir / "kernel_caches.json"
        capacity = json.loads(chosen.read_text()).get("capacity") if chosen.is_file() else None
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        if capacity in (None, "default"):
            env.pop(name, None)
        else:
            env[name] = str(capacity)
    if side in ("rlhf", "floor"):
        checkout = str(Path(settings.get("checkout", ROOT)).resolve())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (checkout, env.get("PYTHONPATH", "")) if p)
    return env


def worker_command(args: argparse.Namespace, job: str, spec: str, steps: int, out: Path) -> list[str]:
    """The command line of one run: that side's interpreter, the worker, the job and the settings."""
    side, settings = parse_side(spec)
    python = args.trl_python if side == "trl" else args.rlhf_python
    return [python, str(WORKER), "run", "--side", side, "--job", job, "--work-dir", str(args.work_dir),
            "--steps", str(steps), "--cpu-linear", settings.get("cpu-linear", args.cpu_linear), "--out", str(out),
            "--dtype", args.dtype, "--set", args.set]


def run_side(args: argparse.Namespace, job: str, spec: str, steps: int, out: Path) -> dict[str, Any]:
    side, _ = parse_side(spec)
    command = worker_command(args, job, spec, steps, out)
    log = out.with_suffix(".log")
    with log.open("w") as handle:
        code = subprocess.call(command, env=side_env(args, spec, job), stdout=handle, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise SystemExit(f"{side} on {job} failed (exit {code}); the end of {log}:\n{tail}")
    return json.loads(out.read_text())


def work_per_step(run: dict[str, Any]) -> list[dict[str, float]]:
    return [{k: round(v, 3) for k, v in step.items() if k in WORK_KEYS} for step in run["work"][1:]]


def equal_work(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None if both runs counted the same work on every measured step, else what differs."""
    wa, wb = work_per_step(a), work_per_step(b)
    if len(wa) != len(wb):
        return f"{len(wa)} against {len(wb)} measured steps"
    for step, (x, y) in enumerate(zip(wa, wb), start=2):
        for key in sorted(set(x) & set(y)):
            if abs(x[key] - y[key]) > 1e-6 * max(1.0, abs(x[key])):
                return f"step {step}: {key} {x[key]:g} against {y[key]:g}"
        missing = set(WORK_KEYS) & (set(x) ^ set(y))
        if missing:
            return f"step {step}: {', '.join(sorted(missing))} counted by one side only"
    return None


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median CPU and wall s/step over every measured step of every round; min-max of the round medians."""
    cpu = [c for run in runs for c in run["cpu"][1:]]
    rounds = [statistics.median(run["cpu"][1:]) for run in runs]
    return dict(cpu=statistics.median(cpu), cpu_rounds=rounds, wall=statistics.median(
        [w for run in runs for w in run["wall"][1:]]), peak_rss_mb=max(run["peak_rss_mb"] for run in runs),
        steps=len(cpu), work=runs[0]["work"][1:], kernels=runs[0].get("kernels"),
        versions=runs[0].get("versions"), foreign_imports=sorted({m for r in runs for m in r["foreign_imports"]}),
        **({"state_floor_mb": statistics.median(r["state_floor_mb"] for r in runs)}
           if all("state_floor_mb" in r for r in runs) else {}))


def memory_overheads(stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each side's peak RSS above the training-state floor the floor side measured (libraries,
    weights, a gradient and two AdamW moments per trainable parameter), and rlhf's overhead over
    TRL's; empty without a floor measurement."""
    floor = next((s["state_floor_mb"] for side, s in stats.items() if "state_floor_mb" in s), None)
    if floor is None:
        return {}
    above = {side: s["peak_rss_mb"] - floor for side, s in stats.items()}
    out: dict[str, Any] = {"state_floor_mb": floor, "above_floor_mb": above}
    rlhf = next((v for side, v in above.items() if side.startswith("rlhf")), None)
    trl = next((v for side, v in above.items() if side.startswith("trl")), None)
    if rlhf is not None and trl is not None and trl > 0:
        out["rlhf/trl"] = rlhf / trl
    return out


def ratio_line(name: str, num: dict[str, Any], den: dict[str, Any], num_runs: list, den_runs: list) -> str:
    """num / den of the median CPU s/step, with the min-max of the per-round ratios, and of the peak RSS."""
    per_round = [statistics.median(a["cpu"][1:]) / statistics.median(b["cpu"][1:]) for a, b in zip(num_runs, den_runs)]
    return (f"{name} {num['cpu'] / den['cpu']:.2f} ({min(per_round):.2f}-{max(per_round):.2f}), "
            f"peak RSS {num['peak_rss_mb'] / den['peak_rss_mb']:.2f}")


def slug(spec: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in spec)


def ratio_pairs(sides: list[str]) -> list[tuple[str, str]]:
    """(numerator, denominator) for every two sides: the floor is always the denominator, else the
    later side over the earlier (trl/rlhf with the default order)."""
    pairs = []
    for i, first in enumerate(sides):
        for second in sides[i + 1:]:
            if first.startswith("floor"):
                pairs.append((second, first))
            elif second.startswith("floor"):
                pairs.append((first, second))
            else:
                pairs.append((second, first))
    return sorted(pairs, key=lambda pair: pair[1].startswith("floor"))


def markdown(report: dict[str, Any]) -> str:
    """One table row per job: each side's median CPU s/step (min-max of its round medians) and peak
    RSS, then the ratios (min-max of the per-round ratios) or why there is none."""
    sides = [side for side in SIDES if any(side in job["sides"] for job in report["jobs"].values())]
    head = (["job", "rounds x steps"] + [f"{side} CPU s/step" for side in sides] + [f"{side} peak MB" for side in sides]
            + [pair for pair in ("trl/rlhf", "rlhf/floor", "trl/floor")
               if all(part in sides for part in pair.split("/"))])
    memory = any(job.get("memory") for job in report["jobs"].values())
    if memory:
        head += ["state floor MB", "above it MB (" + " / ".join(s for s in sides if s != "floor") + ")",
                 "overhead rlhf/trl"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, job in report["jobs"].items():
        cells = [f"`{name}`", f"{job['rounds']} x {job['steps'] - 1}"]
        for side in sides:
            s = job["sides"].get(side)
            cells.append(f"{s['cpu']:.3f} ({min(s['cpu_rounds']):.3f}-{max(s['cpu_rounds']):.3f})" if s else "-")
        cells += [f"{job['sides'][side]['peak_rss_mb']:,.0f}" if side in job["sides"] else "-" for side in sides]
        for pair in head[2 + 2 * len(sides):len(head) - 3 * memory]:
            verdict = job["ratios"].get(pair, "-")
            cells.append(verdict.split(" ", 1)[1].split(", peak")[0] if verdict.startswith(pair) else verdict)
        if memory:
            m = job.get("memory") or {}
            above = m.get("above_floor_mb", {})
            cells += [f"{m['state_floor_mb']:,.0f}" if m else "-",
                      " / ".join(f"{above[s]:,.0f}" if s in above else "-" for s in sides if s != "floor"),
                      f"{m['rlhf/trl']:.2f}" if "rlhf/trl" in m else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rlhf-python", default=sys.executable, help="interpreter with rlhf (this checkout on its path)")
    parser.add_argument("--trl-python", default=None, help="interpreter with TRL (needed for the trl side)")
    parser.add_argument("--jobs", default="grpo-small,dpo,sft,sft-packing", help=f"comma-separated: {', '.join(JOBS)}")
    parser.add_argument("--sides", default="rlhf,trl,floor")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the job's; the first is dropped)")
    parser.add_argument("--cpu-linear", default="torch", choices=["auto", "torch", "onednn"],
                        help="rlhf's --cpu-linear (torch: MKL's products, as TRL and the floor use)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                        help="the weights' dtype on every side: rlhf --dtype, TRL's model loaded so with bf16=True "
                             "(its Trainer's autocast), the floor's model loaded so")
    parser.add_argument("--mmap-threshold", default="rlhf",
                        help="MALLOC_MMAP_THRESHOLD_ for every side: rlhf (the threshold rlhf's run prologue picks for "
                             "the job's model, given to every side), bytes, or 'default' (unset: rlhf sets its own, "
                             "the other sides keep glibc's dynamic threshold)")
    parser.add_argument("--kernel-caches", default="rlhf",
                        help="ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY for every side: rlhf (the bound "
                             "rlhf's run prologue sets, given to every side), a count, or 'default' (unset: rlhf sets "
                             "its own, the other sides keep oneDNN's)")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "rlhf-harness"))
    parser.add_argument("--set", default="", help="GRPO shape overrides for every side (bench_worker.py --set), "
                                                  "e.g. model=small4k,n=8,max_new_tokens=512")
    parser.add_argument("--json", default=None, help="write every run's figures here")
    parser.add_argument("--label", default="", help="a label for this measurement in the JSON file")
    parser.add_argument("--render", default=None, help="print the markdown table of a saved --json file, run nothing")
    args = parser.parse_args()
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())))
        return
    jobs, sides = args.jobs.split(","), split_sides(args.sides)
    if any(parse_side(side)[0] == "trl" for side in sides) and not args.trl_python:
        parser.error("the trl side needs --trl-python (an interpreter whose environment has trl; see benchmarks/README.md)")
    args.work_dir = Path(args.work_dir)
    steps = {job: args.steps or __import__("bench_worker", fromlist=["JOBS"]).JOBS[job]["steps"] for job in jobs}
    prepared = subprocess.call([args.rlhf_python, str(WORKER), "prepare", "--work-dir", str(args.work_dir),
                                "--jobs", ",".join(jobs), "--steps", str(max(steps.values())), "--set", args.set],
                               env=side_env(args, "rlhf"))
    if prepared:
        raise SystemExit("preparing the models and data failed")
    runs_dir = args.work_dir / "results"
    runs_dir.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  {cpu_model()} ({cpu_flags()}), {os.cpu_count()} cores, one torch "
          f"thread a side; load average {', '.join(f'{x:.2f}' for x in load[0])}")
    heap = json.loads((args.work_dir / "heap.json").read_text()) if (args.work_dir / "heap.json").is_file() else {}
    print(f"rlhf --cpu-linear {args.cpu_linear}; MALLOC_MMAP_THRESHOLD_ {args.mmap_threshold} on every side "
          f"{heap if args.mmap_threshold == 'rlhf' else ''}; oneDNN kernel caches {args.kernel_caches} "
          f"{side_env(args, 'trl').get('ONEDNN_PRIMITIVE_CACHE_CAPACITY', 'unset')} on every side; "
          f"{args.rounds} rounds, interleaved, weights {args.dtype}{'; GRPO ' + args.set if args.set else ''}")
    report: dict[str, Any] = {"cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "label": args.label,
                              "cpu_linear": args.cpu_linear, "mmap_threshold": args.mmap_threshold, "heap": heap,
                              "kernel_caches": side_env(args, "trl").get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
                              "dtype": args.dtype,
                              "set": args.set,
                              "jobs": {}}
    for job in jobs:
        results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for round_ in range(args.rounds):
            order = sides[round_ % len(sides):] + sides[:round_ % len(sides)]
            for side in order:
                run = run_side(args, job, side, steps[job], runs_dir / f"{job}-{slug(side)}-{round_}.json")
                results[side].append(run)
                print(f"  {job} round {round_ + 1} {side:>5}: {statistics.median(run['cpu'][1:]):.3f} CPU s/step, "
                      f"peak {run['peak_rss_mb']:.0f} MB, load {run['load'][1][0]:.1f}", flush=True)
        load.append(os.getloadavg())
        stats = {side: summary(runs) for side, runs in results.items()}
        print(f"{job}: {steps[job]} steps a run, first dropped, {args.rounds} rounds")
        for side, s in stats.items():
            rounds = ", ".join(f"{x:.3f}" for x in s["cpu_rounds"])
            work = {k: v for k, v in s["work"][0].items()} if s["work"] else {}
            print(f"  {side:>5}: {s['cpu']:.3f} CPU s/step (rounds {rounds}), wall {s['wall']:.2f} s, "
                  f"peak RSS {s['peak_rss_mb']:.0f} MB; work/step {work}; {s['kernels']}")
            if s["foreign_imports"]:
                print(f"  {side} imported {s['foreign_imports']}: the sides were not separate")
        lines, verdicts = [], {}
        for num, den in ratio_pairs(sides):
            differs = equal_work(results[num][0], results[den][0]) or next(
                (d for a, b in zip(results[num], results[den]) if (d := equal_work(a, b))), None)
            if differs:
                verdicts[f"{num}/{den}"] = f"work differs: {differs}"
                lines.append(f"{num}/{den}: no ratio, work differs ({differs})")
            else:
                line = ratio_line(f"{num}/{den}", stats[num], stats[den], results[num], results[den])
                verdicts[f"{num}/{den}"] = line
                lines.append(line)
        print("  " + "; ".join(lines), flush=True)
        memory = memory_overheads(stats)
        if memory:
            print(f"  training-state floor {memory['state_floor_mb']:,.0f} MB; peak above it: "
                  + ", ".join(f"{side} {mb:,.0f} MB" for side, mb in memory["above_floor_mb"].items())
                  + (f"; rlhf/trl {memory['rlhf/trl']:.2f}" if "rlhf/trl" in memory else ""), flush=True)
        report["jobs"][job] = {"steps": steps[job], "rounds": args.rounds, "sides": stats, "ratios": verdicts,
                               "memory": memory,
                               "runs": {side: [{k: r[k] for k in ("cpu", "wall", "peak_rss_mb", "load")}
                                               for r in runs] for side, runs in results.items()}}
    report["load"] = load
    print(f"load average during the runs: {', '.join(f'{x[0]:.1f}' for x in load)} (1-minute, after each job)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if all(side in SIDES for side in sides):
        print(markdown(report))


if __name__ == "__main__":
    main()
