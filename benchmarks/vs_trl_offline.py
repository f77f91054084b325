"""`rlhf sft` and `rlhf dpo` against TRL's SFTTrainer and DPOTrainer on the same work, alternating.

Both sides get the same random model, the same prompt/response (SFT) and prompt/chosen/rejected
(DPO) rows of mixed lengths, the same batch size, micro-batch size (gradient accumulation),
steps, AdamW settings (lr, betas 0.9/0.95, no weight decay, clip 1.0, constant LR), loss on the
responses only, EOS appended, DPO's sigmoid loss with β = 0.1 and a frozen reference copy, no
gradient checkpointing. Runs alternate (rlhf, TRL, rlhf, ...); each run's first step is dropped
and the medians of the rest are reported as samples/s (examples or pairs per second).

TRL is not a dependency of rlhf: run this with a Python that has both (see benchmarks/README.md):

    PYTHONPATH=. /work/trl-venv/bin/python benchmarks/vs_trl_offline.py --task sft --model small --threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven small cats sing about green apples".split()


def write_data(root: Path, rows: int, seed: int) -> tuple[Path, Path]:
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    sft, pairs = root / "offline-sft.jsonl", root / "offline-pairs.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Q: {text(2, 12)}?", "completion": " " + text(3, 30)}) + "\n"
                           for _ in range(rows)))
    pairs.write_text("".join(json.dumps({"prompt": f"Q: {text(2, 12)}?", "chosen": " " + text(3, 20),
                                         "rejected": " " + text(3, 20)}) + "\n" for _ in range(rows)))
    return sft, pairs


def offline_model(name: str, root: Path) -> Path:
    """A random Llama of benchlib's sizes whose EOS is in its vocabulary (both sides append it)."""
    if name not in benchlib.MODELS:
        return Path(name)
    hidden, layers, _ = benchlib.MODELS[name]
    out = root / f"offline-{name}-h{hidden}-l{layers}"
    if not (out / "config.json").is_file():
        from rlhf.core.plugin_host.references import import_object

        build = import_object(f"{benchlib.ROOT / 'examples' / 'tiny_model.py'}:build_random_model")
        build(out, hidden=hidden, layers=layers, heads=max(1, hidden // 64), max_positions=1024)
    return out


def run_ours(args, model: Path, data: Path, out: Path) -> benchlib.StepClock:
    from rlhf.cli.main import make_cli
    from rlhf.core.plugin_host.loading import build_plugin_manager

    shutil.rmtree(out, ignore_errors=True)
    plugins = build_plugin_manager()
    clock = benchlib.StepClock()
    plugins.register(benchlib.step_clock_plugin(clock), name="benchmark_step_clock")
    task = ["sft", "--output-key", "completion"] if args.task == "sft" else ["dpo", "--beta", "0.1"]
    extra = ["--packing"] if args.packing else []
    clock.start()
    make_cli(plugins)(args=task + [
        "--model", str(model), "--data", str(data), "--batch-size", str(args.batch_size),
        "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps), "--lr", str(args.lr),
        "--adam-betas", "0.9,0.95", "--weight-decay", "0", "--max-grad-norm", "1.0", "--lr-scheduler", "constant",
        "--out", str(out), "--no-progress", "--seed", str(args.seed), "--cpu-linear", args.cpu_linear] + extra,
        standalone_mode=False)
    return clock


def run_trl(args, model: Path, data: Path, out: Path) -> benchlib.StepClock:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    shutil.rmtree(out, ignore_errors=True)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    common = dict(
        output_dir=str(out), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.batch_size // args.micro_batch_size, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=args.seed, max_length=1024)
    clock = benchlib.StepClock()

    class Stamp(TrainerCallback):
        def on_train_begin(self, *_, **__):
            clock.start()

        def on_step_end(self, *_, **__):
            clock.stamp()

    tokenizer = AutoTokenizer.from_pretrained(model)
    if args.task == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model),
                             args=SFTConfig(**common, completion_only_loss=True, padding_free=args.packing),
                             train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[Stamp()])
    else:
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model),
                             args=DPOConfig(**common, beta=0.1, loss_type="sigmoid"),
                             train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[Stamp()])
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["sft", "dpo"], default="sft")
    parser.add_argument("--model", default="tiny", help="tiny or small (320-token vocabulary) or a model directory")
    parser.add_argument("--batch-size", type=int, default=32, help="examples (pairs) per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is dropped)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--packing", action="store_true", help="--packing on our side, padding_free on TRL's (SFT)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None)
    benchlib.add_cpu_linear_argument(parser)
    args = parser.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("vs_trl_offline.py needs TRL next to rlhf in one Python environment: see benchmarks/README.md")
    if args.batch_size % args.micro_batch_size:
        parser.error("--micro-batch-size must divide --batch-size")
    threads = benchlib.setup_environment(args.threads)
    import torch

    root = benchlib.work_dir(args.work_dir)
    model = offline_model(args.model, root)
    sft, pairs = write_data(root, rows=args.batch_size * (args.steps + 1), seed=args.seed)
    data = sft if args.task == "sft" else pairs
    print(benchlib.machine_line(threads))
    print(benchlib.cpu_linear_line(args.cpu_linear))
    print(f"{args.task} model {args.model}  batch {args.batch_size} micro {args.micro_batch_size}  "
          f"{args.steps} steps x {args.rounds} rounds, alternating")
    sides = {"rlhf": run_ours, "trl": run_trl}
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(args.rounds):
        for name, run in sides.items():
            torch.manual_seed(args.seed + round_)
            torch.set_num_threads(threads)
            clock = run(args, model, data, root / "runs" / f"vs_trl_offline-{name}")
            wall[name] += benchlib.steady(clock.intervals)
            cpu[name] += benchlib.steady(clock.cpu_intervals)
            print(f"round {round_ + 1} {name:>4}: {benchlib.median(benchlib.steady(clock.intervals)):.4f} s/step "
                  f"(load {Path('/proc/loadavg').read_text().split()[0]})", flush=True)
    med = benchlib.median
    print(f"\n{'':6}{'s/step (wall)':>14}{'s/step (CPU)':>14}{'samples/s':>11}")
    for name in sides:
        print(f"{name:6}{med(wall[name]):14.4f}{med(cpu[name]):14.4f}{args.batch_size / med(wall[name]):11.1f}")
    print(f"speed-up rlhf / trl ({args.task}): {med(wall['trl']) / med(wall['rlhf']):.2f}x wall clock, "
          f"{med(cpu['trl']) / med(cpu['rlhf']):.2f}x CPU time (goal >= 1.3x)")


if __name__ == "__main__":
    main()
