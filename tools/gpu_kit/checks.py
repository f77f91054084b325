"""The checks, in the order the plan prints them: what each runs, how long it may take, how it is judged.

Sizes: on the GPU (bf16), each check is sized to end well inside its timeout on an H100 or H200;
with ``Context.cpu`` (the dry run) the same commands run at toy sizes in float32 on a CPU, where
learning criteria are not judged (a few toy steps show nothing) but every comparison is.

What learns where: a random-weight model does not learn the quickstart's addition in a few steps,
so "reward rises" is judged twice, on the shipped tiny model with the quickstart's task
(`quickstart_grpo`, its known curve) and on a ~113M-parameter random Llama with the benchmarks'
count-the-a's reward, which a random model climbs within a few steps (`grpo_113m`: also the step
time, tokens/s and peak memory figures).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

from tools.gpu_kit.environment import environment
from tools.gpu_kit.pytest_check import pytest_gpu
from tools.gpu_kit.runs import Context, Outcome, Run, build_llama, parameter_count, write_count_a_task
from tools.gpu_kit.verdicts import Verdict, all_finite, at_step, compare, ends, series, steady_median


@dataclass(frozen=True)
class Check:
    name: str
    measures: str  # one line for the plan
    timeout_s: int  # on the GPU
    expected_s: int  # typical wall time on an H100/H200 with the other checks beside it (the plan's estimate)
    runs: Callable[[Context], list[Run]] | None = None  # rlhf commands, run in order in the check's process
    judge: Callable[[Context, list[Outcome]], Verdict] | None = None
    prepare: Callable[[Context], str] | None = None  # builds inputs; returns why the check is skipped, or ""
    execute: Callable[[Context], Verdict] | None = None  # a check that is not rlhf commands
    alone: bool = False  # its figures are timings: nothing runs beside it
    required: bool = False  # when it fails, the checks after it are not started


def rl_figures(verdict: Verdict, outcome: Outcome, prefix: str = "") -> None:
    metrics = outcome.metrics
    first, last = ends(series(metrics, "reward/mean"))
    figures = {
        "steps": len(metrics),
        "reward first": first,
        "reward last": last,
        "s/step": steady_median(series(metrics, "time/step")),
        "generated tokens/s": steady_median(series(metrics, "throughput/tokens_per_s")),  # over the whole step
        "rollout s/step": steady_median(series(metrics, "time/rollout")),
        "train s/step": steady_median(series(metrics, "time/train")),
        "peak alloc GiB": outcome.peak_alloc_gib,
        "peak reserved GiB": outcome.peak_reserved_gib,
        "wall s": outcome.wall_s,
    }
    verdict.figures.update({f"{prefix}{k}": v for k, v in figures.items()})


def judge_rises(verdict: Verdict, ctx: Context, values: list[float], what: str, *, at_least: float) -> None:
    first, last = ends(values)
    if ctx.cpu:
        verdict.judge(f"{what} rises", None, "not judged at the dry run's toy size")
    elif first is None or last is None:
        verdict.judge(f"{what} rises", False, "no values logged")
    else:
        verdict.judge(f"{what} rises", last - first >= at_least,
                      f"first quarter {first:.3f} -> last quarter {last:.3f} (must gain {at_least})")


# --- the README's quickstart: the shipped tiny model learns to stop after the sum -------------------

def quickstart_args(ctx: Context, out: str, *, steps: int, prompts: int, n: int, tokens: int,
                    algo: str = "grpo") -> list[str]:
    return ["train", "--algo", algo, "--model", ctx.example("tiny-model"), "--data", ctx.example("data", "train.jsonl"),
            "--input-key", "prompt", "--label-key", "answer", "--reward", f"{ctx.example('rewards.py')}:exact_match",
            "--n-samples", str(n), "--prompts-per-step", str(prompts), "--max-new-tokens", str(tokens),
            "--steps", str(steps), "--lr", "1e-4", "--seed", "0", "--no-progress", "--out", str(ctx.work / out),
            *ctx.device_args]


def quickstart_runs(ctx: Context) -> list[Run]:
    size = dict(steps=2, prompts=4, n=4, tokens=8) if ctx.cpu else dict(steps=30, prompts=16, n=8, tokens=16)
    return [Run("grpo", quickstart_args(ctx, "quickstart", **size))]


def quickstart_judge(ctx: Context, outcomes: list[Outcome]) -> Verdict:
    verdict = Verdict()
    rl_figures(verdict, outcomes[0])
    judge_rises(verdict, ctx, series(outcomes[0].metrics, "reward/mean"), "mean reward", at_least=0.25)
    return verdict


# --- GRPO on a ~113M-parameter Llama: learning, step time, tokens/s, peak memory --------------------

def llama_size(ctx: Context) -> dict[str, int]:
    return dict(hidden=64, layers=2, heads=4) if ctx.cpu else dict(hidden=768, layers=12, heads=12)


def grpo_113m_prepare(ctx: Context) -> str:
    build_llama(ctx.work / "model", **llama_size(ctx))
    write_count_a_task(ctx.repo, ctx.work / "task")
    return ""


def grpo_113m_runs(ctx: Context) -> list[Run]:
    size = dict(steps=3, prompts=2, n=4, tokens=8, batch=8) if ctx.cpu else \
        dict(steps=30, prompts=16, n=8, tokens=64, batch=32)
    return [Run("grpo", [
        "train", "--algo", "grpo", "--model", str(ctx.work / "model"), "--data", str(ctx.work / "task" / "prompts.jsonl"),
        "--input-key", "prompt", "--reward", f"{ctx.work / 'task' / 'count_a.py'}:count_a_dense",
        "--n-samples", str(size["n"]), "--prompts-per-step", str(size["prompts"]),
        "--max-new-tokens", str(size["tokens"]), "--micro-batch-size", str(size["batch"]), "--steps", str(size["steps"]),
        "--lr", "2e-4", "--seed", "0", "--no-progress", "--out", str(ctx.work / "run"), *ctx.device_args])]


def grpo_113m_judge(ctx: Context, outcomes: list[Outcome]) -> Verdict:
    verdict = Verdict()
    verdict.figures["parameters (M)"] = parameter_count(ctx.work / "model") / 1e6
    rl_figures(verdict, outcomes[0])
    judge_rises(verdict, ctx, series(outcomes[0].metrics, "reward/mean"), "a's per completion", at_least=1.0)
    return verdict


# --- PPO with a critic -----------------------------------------------------------------------------

def ppo_runs(ctx: Context) -> list[Run]:
    size = dict(steps=2, prompts=4, n=2, tokens=8) if ctx.cpu else dict(steps=10, prompts=16, n=4, tokens=12)
    return [Run("ppo", quickstart_args(ctx, "ppo", algo="ppo", **size))]


def ppo_judge(ctx: Context, outcomes: list[Outcome]) -> Verdict:
    verdict = Verdict()
    metrics = outcomes[0].metrics
    rl_figures(verdict, outcomes[0])
    critic = series(metrics, "critic/loss")
    verdict.figures["critic loss first"], verdict.figures["critic loss last"] = ends(critic)
    verdict.judge("critic trained every step", len(critic) == len(metrics) and all_finite(critic),
                  f"{len(critic)} finite critic losses in {len(metrics)} steps")
    verdict.judge("policy loss finite", all_finite(series(metrics, "policy/loss")))
    return verdict


# --- --packing against padded (shared-prompt for DPO) forwards, through the offline commands ---------

def fit_args(ctx: Context, command: str, out: str, packing: bool) -> list[str]:
    pipeline = ctx.example("pipeline")
    data = ["--data", f"{pipeline}/sft.jsonl"] if command == "sft" else \
        ["--data", f"{pipeline}/pairs.jsonl", "--beta", "0.1"]
    steps = 2 if ctx.cpu else 4
    return [command, "--model", ctx.example("tiny-model"), *data, "--max-samples", "128", "--batch-size", "32",
            "--micro-batch-size", "16", "--steps", str(steps), "--lr", "1e-4", "--seed", "0", "--no-progress",
            "--packing" if packing else "--no-packing", "--out", str(ctx.work / out), *ctx.device_args]


def packing_runs(command: str) -> Callable[[Context], list[Run]]:
    def runs(ctx: Context) -> list[Run]:
        return [Run("padded", fit_args(ctx, command, "padded", False)), Run("packed", fit_args(ctx, command, "packed", True))]
    return runs


def packing_judge(ctx: Context, outcomes: list[Outcome]) -> Verdict:
    """Step 1 runs the same weights on the same examples: equal loss and gradient norm. Step 2 is one
    optimizer step later: equal loss too (DPO's step-1 loss is log 2 whatever the forward, so its
    step 2 is the informative one)."""
    verdict = Verdict()
    padded, packed = outcomes[0].metrics, outcomes[1].metrics
    for outcome in outcomes:  # units: SFT's loss tokens, DPO's pairs
        steps = series(outcome.metrics, "time/step")
        units = series(outcome.metrics, "train/units")
        rates = [u / s for u, s in zip(units, steps) if s > 0]
        verdict.figures[f"{outcome.label} s/step"] = steady_median(steps)
        verdict.figures[f"{outcome.label} units/s"] = steady_median(rates)
        verdict.figures[f"{outcome.label} peak alloc GiB"] = outcome.peak_alloc_gib
    verdict.figures["loss first"], verdict.figures["loss last"] = ends(series(padded, "train/loss"))
    compare(verdict, "step 1 loss", at_step(packed, 1, "train/loss"), at_step(padded, 1, "train/loss"), ctx.precision)
    compare(verdict, "step 1 grad norm", at_step(packed, 1, "train/grad_norm"), at_step(padded, 1, "train/grad_norm"),
            ctx.precision)
    compare(verdict, "step 2 loss", at_step(packed, 2, "train/loss"), at_step(padded, 2, "train/loss"), ctx.precision)
    return verdict


# --- DeepSpeed ZeRO-2 and ZeRO-3 on one device, against the torch backend ---------------------------

def deepspeed_prepare(ctx: Context) -> str:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (the bundle's wheel did not install)"
    return ""


def deepspeed_runs(stage: int) -> Callable[[Context], list[Run]]:
    def runs(ctx: Context) -> list[Run]:
        size = dict(steps=2, prompts=2, n=4, tokens=8) if ctx.cpu else dict(steps=3, prompts=8, n=4, tokens=12)
        return [Run("torch", quickstart_args(ctx, "torch", **size)),
                Run(f"zero{stage}", [*quickstart_args(ctx, f"zero{stage}", **size), "--backend", "deepspeed",
                                     "--zero-stage", str(stage)])]
    return runs


def deepspeed_judge(ctx: Context, outcomes: list[Outcome]) -> Verdict:
    """Both runs sample their first batch from the same weights under the same seed. When the samples
    agree (equal step-1 rewards), the step-1 loss and gradient norm must agree too. Only step 1:
    DeepSpeed's bf16 optimizer keeps float32 master weights where the torch backend steps the bf16
    weights, so later steps differ by design (tests/deepspeed compares every step in float32 on a CPU)."""
    verdict = Verdict()
    reference, sharded = outcomes[0].metrics, outcomes[1].metrics
    rl_figures(verdict, outcomes[1], prefix="")
    verdict.figures["torch s/step"] = steady_median(series(reference, "time/step"))
    verdict.judge("losses finite", all_finite(series(sharded, "policy/loss")))
    same_samples = at_step(reference, 1, "reward/mean") == at_step(sharded, 1, "reward/mean")
    if not same_samples:
        verdict.judge("step 1 equals the torch backend's", None,
                      "the first batches' samples differ (step-1 rewards differ): losses not comparable")
        return verdict
    compare(verdict, "step 1 loss", at_step(sharded, 1, "policy/loss"), at_step(reference, 1, "policy/loss"),
            ctx.precision)
    compare(verdict, "step 1 grad norm", at_step(sharded, 1, "policy/grad_norm"),
            at_step(reference, 1, "policy/grad_norm"), ctx.precision)
    return verdict


CHECKS = (
    Check("environment", "GPU, CUDA, versions; rlhf imports from this checkout; datasets and deepspeed import",
          timeout_s=60, expected_s=10, execute=environment, required=True),
    Check("grpo_113m", "GRPO, bf16, hf engine, 113M-param random Llama, 16 prompts x 8 samples x 64 tokens, 30 steps: "
          "a's per completion rise; s/step, tokens/s, peak memory", timeout_s=180, expected_s=75,
          prepare=grpo_113m_prepare, runs=grpo_113m_runs, judge=grpo_113m_judge, alone=True),
    Check("pytest_gpu", "pytest -m gpu: CUDA numerics (packing, shared prompts and segment attention, chunked "
          "log-probs against full ones), flash-attn, QLoRA and vLLM tests where installed",
          timeout_s=180, expected_s=50, execute=pytest_gpu),
    Check("deepspeed_zero3", "GRPO on the tiny model, --backend deepspeed --zero-stage 3, 3 steps: "
          "step 1 equals the torch backend's", timeout_s=150, expected_s=50,
          prepare=deepspeed_prepare, runs=deepspeed_runs(3), judge=deepspeed_judge),
    Check("deepspeed_zero2", "the same with --zero-stage 2", timeout_s=150, expected_s=45,
          prepare=deepspeed_prepare, runs=deepspeed_runs(2), judge=deepspeed_judge),
    Check("quickstart_grpo", "the README quickstart, bf16, 30 steps: mean reward rises by 0.25",
          timeout_s=120, expected_s=40, runs=quickstart_runs, judge=quickstart_judge),
    Check("dpo_packing", "rlhf dpo --packing against the padded (shared-prompt) run, 4 steps: equal losses, "
          "gradient norms", timeout_s=100, expected_s=30, runs=packing_runs("dpo"), judge=packing_judge),
    Check("sft_packing", "rlhf sft --packing against the padded run, 4 steps: equal losses, gradient norms",
          timeout_s=100, expected_s=25, runs=packing_runs("sft"), judge=packing_judge),
    Check("ppo_critic", "PPO with a critic on the tiny model, 10 steps: critic and policy losses finite",
          timeout_s=100, expected_s=25, runs=ppo_runs, judge=ppo_judge),
)


def by_name(names: list[str] | None) -> list[Check]:
    if not names:
        return list(CHECKS)
    known = {check.name: check for check in CHECKS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"gpu kit: no check named {', '.join(unknown)}; the checks are {', '.join(known)}")
    return [check for check in CHECKS if check.name in names]


def run_in_process(check: Check, ctx: Context) -> Verdict:
    """One check in this process: its inputs, its rlhf commands in order (stopping at the first that
    fails), its judgement."""
    if check.execute is not None:
        return check.execute(ctx)
    skip = check.prepare(ctx) if check.prepare else ""
    if skip:
        return Verdict(skipped=skip)
    from tools.gpu_kit.runs import execute

    outcomes = []
    for run in check.runs(ctx):
        outcome = execute(run)
        outcomes.append(outcome)
        if outcome.rc != 0:
            verdict = Verdict()
            verdict.judge(f"rlhf {run.argv[0]} ({run.label}) exits 0", False,
                          f"exit {outcome.rc} after {outcome.wall_s:.0f} s: see the log")
            return verdict
    verdict = check.judge(ctx, outcomes)
    for outcome in outcomes:
        if not outcome.metrics:
            verdict.judge(f"{outcome.label} logged metrics", False, "metrics.jsonl is empty or missing")
    verdict.figures = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                       for k, v in verdict.figures.items()}
    return verdict
