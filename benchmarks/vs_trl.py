"""`rlhf train --algo grpo` against TRL's GRPOTrainer on the same work, alternating runs in one process.

Both sides get the same random model (its EOS lies outside its vocabulary, so every completion
runs to full length), the same prompts, G prompts x n samples per step, the same number of new
tokens, one optimizer step per rollout over the same micro-batches, the same β (0: no reference
model on either side), learning rate, AdamW betas, gradient clipping and constant LR,
temperature 1 with top-k and top-p off, the token-mean loss (TRL's ``dapo``), no gradient
checkpointing (TRL turns it on by default; it would add a forward pass), and the same reward
function (``--reward``: with ``count_a`` a prompt whose samples all score alike has zero
advantages, and rlhf skips their update, which TRL runs; ``count_a_dense`` gives every sample a
nonzero advantage, so both sides train every sample). Runs alternate (ours, TRL, ours, ...); each run's first step is dropped and the
medians of the rest are reported, with samples/s (= G x n / median step time) and generated
tokens per step. Wall clock and this process's CPU time are both reported: on a shared machine
CPU time is the steadier figure (with one torch thread it is the work done, whatever else runs).

TRL is not a dependency of rlhf: run this with a Python that has both (see benchmarks/README.md):

    python3 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0 trl -e .
    /work/trl-venv/bin/python benchmarks/vs_trl.py [--model tiny|small|small32k|DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

NO_TRL = """vs_trl.py needs TRL next to rlhf in one Python environment (TRL is not an rlhf dependency):

    python3 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0 trl -e {root}
    /work/trl-venv/bin/python {script}

(pin torch to the version you have: an unpinned install may pull the CUDA build)"""


MARKS_PLUGIN = None  # an extra plugin for our side's run (benchmarks/vocab_memory.py's memory marks)
OURS_EXTRA: dict = {}  # more TrainConfig keys for our side (benchmarks/scale.py: lora_rank)
TRL_EXTRA: dict = {}  # more GRPOTrainer arguments for TRL's side (benchmarks/scale.py: peft_config)


def run_ours(args, model: Path, data: Path, reward: Path, out: Path) -> benchlib.StepClock:
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.rl.local import train

    shutil.rmtree(out, ignore_errors=True)
    config = TrainConfig.from_dict(dict(
        model=str(model), data=[str(data)], reward=[f"{reward}:{args.reward}"], algo="grpo", kl_coef=args.kl_coef,
        loss_agg="token_mean", prompts_per_step=args.prompts, n_samples=args.n, max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch_size, steps=args.steps, lr=args.lr, adam_betas="0.9,0.95",
        weight_decay=0.0, max_grad_norm=1.0, lr_scheduler="constant", clip_low=0.2, clip_high=0.2,
        temperature=1.0, top_p=1.0, out=str(out), progress=False, seed=args.seed, share_prompt=args.share_prompt,
        cpu_linear=args.cpu_linear, vocab_chunks=getattr(args, "vocab_chunks", True), **OURS_EXTRA))
    plugins = build_plugin_manager()
    clock = benchlib.StepClock()
    plugins.register(benchlib.step_clock_plugin(clock), name="benchmark_step_clock")
    if MARKS_PLUGIN is not None:
        plugins.register(MARKS_PLUGIN, name="benchmark_marks")
    clock.start()
    train(config, plugins=plugins)
    for metrics in clock.metrics:
        metrics["tokens"] = metrics["response/length_mean"] * args.prompts * args.n
    return clock


def run_trl(args, model: Path, data: Path, reward: Path, out: Path) -> benchlib.StepClock:
    import json

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.core.plugin_host.references import import_object

    shutil.rmtree(out, ignore_errors=True)
    rollout = args.prompts * args.n
    config = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=rollout // args.micro_batch_size,
        num_generations=args.n, max_completion_length=args.max_new_tokens, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
        weight_decay=0.0, max_grad_norm=1.0, beta=args.kl_coef, loss_type="dapo", epsilon=0.2, num_iterations=1,
        temperature=1.0, top_p=1.0, top_k=0, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=args.seed)
    prompts = [json.loads(line) for line in data.read_text().splitlines()]
    clock = benchlib.StepClock()

    class Stamp(TrainerCallback):
        def on_train_begin(self, *_, **__):
            clock.start()

        def on_step_end(self, *_, **__):
            clock.stamp()

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs and clock.metrics:
                clock.metrics[-1]["tokens"] = logs["completions/mean_length"] * rollout

    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model),
                          reward_funcs=import_object(f"{reward}:{args.reward}"), args=config,
                          train_dataset=Dataset.from_list(prompts),
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Stamp()],
                          **TRL_EXTRA)

    trainer.remove_callback(PrinterCallback)  # it prints every log line (disable_tqdm swaps it in)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_step_arguments(parser, rounds=3, other="TRL", kl_help="β on both sides (> 0 loads a reference model)")
    parser.add_argument("--no-share-prompt", dest="share_prompt", action="store_false",
                        help="rlhf without --share-prompt (a prompt's samples run their own forwards)")
    parser.add_argument("--reward", choices=benchlib.REWARDS, default="count_a",
                        help="count_a (the letter a; a group whose samples all score alike has zero advantages, "
                             "and rlhf skips its update) or count_a_dense (a tie-break added: every sample trains)")
    args = parser.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit(NO_TRL.format(root=benchlib.ROOT, script=Path(__file__).resolve()))
    if (args.prompts * args.n) % args.micro_batch_size:
        parser.error("--micro-batch-size must divide --prompts x --n")

    threads = benchlib.setup_environment(args.threads)
    import torch

    root = benchlib.work_dir(args.work_dir)
    model = benchlib.model_dir(args.model, root)
    data, reward = benchlib.write_task(root)
    print(benchlib.machine_line(threads))
    print(benchlib.cpu_linear_line(args.cpu_linear))
    print(f"model {args.model}  G={args.prompts} n={args.n} new tokens={args.max_new_tokens} "
          f"micro batch={args.micro_batch_size} beta={args.kl_coef} lr={args.lr}  "
          f"{args.steps} steps x {args.rounds} rounds, alternating")

    sides = {"rlhf": run_ours, "trl": run_trl}
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[float]] = {name: [] for name in sides}
    skipped: list[float] = []  # rlhf's share of samples whose update it skipped (zero advantages)
    for round_ in range(args.rounds):
        for name, run in sides.items():
            torch.manual_seed(args.seed + round_)
            torch.set_num_threads(threads)
            clock = run(args, model, data, reward, root / "runs" / f"vs_trl-{name}")
            wall[name] += benchlib.steady(clock.intervals)
            cpu[name] += benchlib.steady(clock.cpu_intervals)
            tokens[name] += [m["tokens"] for m in benchlib.steady(clock.metrics) if "tokens" in m]
            skipped += [m["policy/zero_advantage_frac"] for m in benchlib.steady(clock.metrics)
                        if "policy/zero_advantage_frac" in m]
            print(f"round {round_ + 1} {name:>4}: {benchlib.median(benchlib.steady(clock.intervals)):.4f} s/step",
                  flush=True)

    rollout = args.prompts * args.n
    med = benchlib.median
    print()
    print(f"{'':6}{'s/step (wall)':>14}{'s/step (CPU)':>14}{'samples/s':>11}{'tokens/step':>13}")
    for name in sides:
        print(f"{name:6}{med(wall[name]):14.4f}{med(cpu[name]):14.4f}{rollout / med(wall[name]):11.1f}"
              f"{med(tokens[name]):13.0f}")
    if skipped:
        print(f"rlhf skipped the update of {100 * sum(skipped) / len(skipped):.0f}% of the samples "
              f"(zero advantages; --reward {args.reward})")
    print(f"speed-up rlhf / trl: {med(wall['trl']) / med(wall['rlhf']):.2f}x wall clock, "
          f"{med(cpu['trl']) / med(cpu['rlhf']):.2f}x CPU time (goal >= 1.5x)")


if __name__ == "__main__":
    main()
