"""``python3 -m tools.gpu_kit`` from the repository root; tools/gpu_check.sh calls it.

    bundle [--dir D] [--no-download] [--leave-out a,b]   build the wheel bundle, list it, check its size
    plan [--cpu] [--commands]          the checks, their timeouts and what each measures
    run [--cpu] [--out D] ...          run the checks, write gpu_check.{json,md,log} into --out
    check NAME --repo R --work W       one check in this process (what `run` starts for each)
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BUDGET_S = 270
DEFAULT_JOBS = {"gpu": 4, "cpu": 2}


def expected_wall(checks, jobs: int) -> float:
    """The plan's estimate: solo checks one after another, the rest packed ``jobs`` at a time."""
    now, ends = 0.0, []  # ends: a heap of the running checks' end times
    for check in checks:
        if check.alone or check.required:
            now = max([now, *ends]) + check.expected_s
            ends = []
            continue
        if len(ends) >= jobs:
            now = max(now, heapq.heappop(ends))
        heapq.heappush(ends, now + check.expected_s)
    return max([now, *ends])


def plan_lines(checks, *, cpu: bool, jobs: int, budget_s: float, commands: bool) -> list[str]:
    from tools.gpu_kit.runs import Context
    from tools.gpu_kit.runner import CPU_TIMEOUT_S

    size = "toy sizes on this CPU, float32; what each measures is said of the GPU sizes" if cpu else "GPU sizes, bf16"
    lines = [f"plan ({size}): each check in a process of its own, up to {jobs} at a time, within {budget_s:.0f} s",
             f"  {'check':<18} {'timeout':>8} {'expected':>9}  measures"]
    for check in checks:
        timeout = max(check.timeout_s, CPU_TIMEOUT_S) if cpu else check.timeout_s
        name = check.name + (" (alone)" if check.alone else "")
        expected = "-" if cpu else f"{check.expected_s} s"  # estimates for the GPU only
        lines.append(f"  {name:<18} {timeout:>6} s {expected:>9}  {check.measures}")
        if commands and check.runs is not None:
            ctx = Context(repo=REPO, work=Path("$WORK") / check.name, cpu=cpu)
            lines += [f"      rlhf {' '.join(run.argv)}" for run in check.runs(ctx)]
    if not cpu:
        lines.append(f"expected on an H100/H200: about {expected_wall(checks, jobs):.0f} s of checks after the "
                     "bundle's install (~10 s); each check stops at its timeout, all of them at the budget")
    return lines


def cmd_bundle(args: argparse.Namespace) -> int:
    from tools.gpu_kit import bundle

    directory = Path(args.dir).resolve()
    entries = bundle.build_bundle(directory, REPO, download=not args.no_download, leave_out=tuple(args.leave_out))
    tree = bundle.tree_size(REPO)
    for line in bundle.describe(entries, directory, tree, args.limit_mib * 2**20):
        print(line)
    bundle.check_size(tree, sum(entry.size for entry in entries), args.limit_mib * 2**20)
    missing = [entry.name for entry in entries if entry.wheel is None]
    if missing and not args.no_download:
        print(f"gpu kit: missing from the bundle: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from tools.gpu_kit.checks import by_name

    jobs = args.jobs or DEFAULT_JOBS["cpu" if args.cpu else "gpu"]
    for line in plan_lines(by_name(args.only), cpu=args.cpu, jobs=jobs, budget_s=args.budget_s, commands=args.commands):
        print(line)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tools.gpu_kit import report
    from tools.gpu_kit.checks import by_name
    from tools.gpu_kit.runner import Runner

    checks = by_name(args.only)
    jobs = args.jobs or DEFAULT_JOBS["cpu" if args.cpu else "gpu"]
    out = Path(args.out or os.environ.get("OUT") or "gpu-check-out").resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="rlhf-gpu-check-")).resolve()
    print("\n".join(plan_lines(checks, cpu=args.cpu, jobs=jobs, budget_s=args.budget_s, commands=False)), flush=True)
    runner = Runner(repo=REPO, work=work, out=out, cpu=args.cpu, budget_s=args.budget_s, jobs=jobs,
                    install_s=args.install_s, say=lambda line: print(line, flush=True))
    summary = runner.run(checks)
    print(report.markdown(summary), flush=True)
    print("\n".join(report.compact(summary)), flush=True)  # last: what a truncated output still shows
    return 0 if summary["summary"]["fail"] == 0 and summary["summary"]["timeout"] == 0 else 1


def cmd_check(args: argparse.Namespace) -> int:
    from tools.gpu_kit.checks import by_name, run_in_process
    from tools.gpu_kit.runs import Context
    from tools.gpu_kit.verdicts import Verdict

    check = by_name([args.name])[0]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        verdict = run_in_process(check, Context(repo=Path(args.repo), work=work, cpu=args.cpu))
    except Exception as exc:  # reported as the check's failure; the traceback goes to its log
        traceback.print_exc()
        verdict = Verdict()
        verdict.judge("check ran to its end", False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    (work / "result.json").write_text(json.dumps(verdict.to_dict(), indent=2, default=str) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: a process group DeepSpeed or NCCL left behind can hang it, and
    # the result is written.
    os._exit(0)


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="python3 -m tools.gpu_kit", description=__doc__.splitlines()[0])
    sub = main.add_subparsers(dest="command", required=True)

    def only(p: argparse.ArgumentParser) -> None:
        p.add_argument("--only", type=lambda s: [n for n in s.split(",") if n], default=None,
                       help="comma-separated check names (default: all)")

    p = sub.add_parser("bundle", help="build the wheel bundle and check the transfer size")
    p.add_argument("--dir", default=str(REPO / ".gpu-bundle"))
    p.add_argument("--no-download", action="store_true", help="build this checkout's wheel only; list the rest")
    p.add_argument("--leave-out", type=lambda s: [n for n in s.split(",") if n], default=[],
                   help="comma-separated pins not to bundle (their checks then skip), e.g. bitsandbytes")
    p.add_argument("--limit-mib", type=int, default=64)
    p.set_defaults(func=cmd_bundle)

    for name, func, text in (("plan", cmd_plan, "print the checks"), ("run", cmd_run, "run the checks")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--cpu", action="store_true", help="toy sizes on a CPU (the dry run)")
        p.add_argument("--jobs", type=int, default=0, help="checks at a time (default: 4 on a GPU, 2 on a CPU)")
        p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
        only(p)
        if name == "plan":
            p.add_argument("--commands", action="store_true", help="also print each check's rlhf commands")
        else:
            p.add_argument("--out", default=None, help="where gpu_check.{json,md,log} go (default: $OUT)")
            p.add_argument("--work", default=None, help="scratch folder (default: a new temporary one)")
            p.add_argument("--install-s", type=float, default=None, help="how long the bundle's install took (reported)")
        p.set_defaults(func=func)

    p = sub.add_parser("check", help="run one check in this process (used by run)")
    p.add_argument("name")
    p.add_argument("--repo", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--cpu", action="store_true")
    p.set_defaults(func=cmd_check)
    return main


if __name__ == "__main__":
    arguments = parser().parse_args()
    sys.exit(arguments.func(arguments))
