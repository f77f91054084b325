"""Peak memory of a GRPO job at a real vocabulary: rlhf against TRL, each side in its own process.

The job: ``rlhf train --algo grpo`` on a random Llama with Qwen2's vocabulary (hidden 512, 4
layers, 151,936 tokens, output layer tied to the embedding: 95M parameters), 8 prompts x 4
samples, 64 new tokens, micro-batch 8, no reference model (β = 0), 3 steps, one torch thread.
Weights, gradients and AdamW's two moments take 16 bytes a parameter (1.5 GB); what a framework
adds on top is mostly the (tokens x vocabulary) float32 logits and their copies.

Each side runs in a fresh process (``--side`` in a child) so that one side's allocations cannot
lower or raise the other's peak; a child reports its peak resident set (``VmHWM``) after
loading, after the first rollout and after the last step, and its step times (the first step
dropped). TRL's side runs when TRL is importable (see benchmarks/vs_trl.py for a venv with both).

    python benchmarks/vocab_memory.py [--sides rlhf,trl] [--model vocab152k] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


def peak_mb() -> float:
    """This process's peak resident set so far, in MB (``VmHWM``: unlike ``ru_maxrss`` it starts
    afresh at exec, so the parent's memory is not counted)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB (macOS: bytes)


def child(args: argparse.Namespace) -> None:
    """One side's run in this process; prints one JSON line."""
    threads = benchlib.setup_environment(args.threads)
    import vs_trl

    root = Path(args.work_dir)
    model, (data, reward) = Path(args.model_dir), benchlib.write_task(root)
    marks: dict[str, float] = {"imported": peak_mb()}
    args.share_prompt, args.cpu_linear = True, "auto"
    if args.side == "rlhf":
        import rlhf

        class Marks:
            @rlhf.hookimpl
            def on_run_start(self, run):
                marks["loaded"] = peak_mb()

            @rlhf.hookimpl
            def on_rollout_end(self, run, step, trajectories):
                marks.setdefault("first rollout", peak_mb())

        vs_trl.MARKS_PLUGIN = Marks()
        clock = vs_trl.run_ours(args, model, data, reward, root / "runs" / "vocab-rlhf")
    else:
        clock = vs_trl.run_trl(args, model, data, reward, root / "runs" / "vocab-trl")
    marks["end"] = peak_mb()
    print(json.dumps({"side": args.side, "threads": threads, "peak_mb": marks,
                      "s_per_step": benchlib.median(benchlib.steady(clock.intervals)),
                      "cpu_s_per_step": benchlib.median(benchlib.steady(clock.cpu_intervals))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="rlhf,trl", help="comma-separated: rlhf, trl")
    parser.add_argument("--model", default="vocab152k", help="a benchlib model name or a model directory")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reward", choices=benchlib.REWARDS, default="count_a_dense")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--no-vocab-chunks", dest="vocab_chunks", action="store_false",
                        help="our side with the full logits (rlhf's --no-vocab-chunks)")
    parser.add_argument("--side", choices=["rlhf", "trl"], help=argparse.SUPPRESS)  # a child's side
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.kl_coef = 0.0
    if args.side:
        return child(args)

    benchlib.setup_environment(args.threads)
    root = benchlib.work_dir(args.work_dir)
    model = benchlib.model_dir(args.model, root)
    print(benchlib.machine_line(args.threads))
    print(f"model {args.model}  G={args.prompts} n={args.n} new tokens={args.max_new_tokens} "
          f"micro batch={args.micro_batch_size} beta=0  {args.steps} steps, one process per side"
          f"{'' if args.vocab_chunks else '  (rlhf: --no-vocab-chunks)'}")
    results = {}
    for side in args.sides.split(","):
        if side == "trl":
            try:
                import trl  # noqa: F401
            except ImportError:
                print("trl: not importable in this Python, skipped (see benchmarks/vs_trl.py)")
                continue
        command = [sys.executable, __file__, "--side", side, "--model-dir", str(model), "--work-dir", str(root)]
        for name in ("prompts", "n", "max_new_tokens", "micro_batch_size", "steps", "threads", "lr", "seed",
                     "reward"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        command += [] if args.vocab_chunks else ["--no-vocab-chunks"]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            sys.exit(f"{side} failed:\n{done.stderr[-3000:]}")
        results[side] = json.loads(lines[-1])
        marks = "  ".join(f"{k} {v:,.0f}" for k, v in results[side]["peak_mb"].items())
        print(f"{side:5} peak RSS {results[side]['peak_mb']['end']:,.0f} MB  "
              f"{results[side]['s_per_step']:.2f} s/step ({results[side]['cpu_s_per_step']:.2f} CPU)  "
              f"[peak so far, MB: {marks}]", flush=True)
    if {"rlhf", "trl"} <= results.keys():
        ours, theirs = results["rlhf"], results["trl"]
        print(f"rlhf / trl: peak {ours['peak_mb']['end'] / theirs['peak_mb']['end']:.2f}x (goal <= 0.6x), "
              f"speed {theirs['s_per_step'] / ours['s_per_step']:.2f}x")


if __name__ == "__main__":
    main()
