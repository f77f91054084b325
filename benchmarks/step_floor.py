"""How close is one `rlhf train` step to the bare model work it contains? Prints the ratio.

Our step is timed in-process through ``rlhf.runtime.rl.local.train`` (wall clock between
``on_step_end`` events, steady state: the first step is dropped; the runtime's own
``time/step`` metric is printed next to it as a cross-check). The bare step does the same
model work with nothing around it, in plain torch + transformers:

1. one ``model.generate`` of the same batch (G prompts x n samples, left padded, temperature 1,
   no top-k/top-p, the same number of new tokens: the models cannot emit EOS);
2. the log-prob forwards our step does: the reference model's when β > 0 (and none for the
   old policy: one optimizer step per rollout is on-policy, so neither side recomputes them);
3. forward + backward over the same micro-batches, gradient clipping and one AdamW step.

Goal: ours / bare <= 1.15. Usage (one command; builds the random models on first use):

    python benchmarks/step_floor.py [--model tiny|small|small32k|DIR] [--micro-batch-size 8] [--kl-coef 0]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


def our_steps(args, model: Path, data: Path, reward: Path, out: Path) -> benchlib.StepClock:
    """Run `rlhf train` in-process; the clock holds each step's wall and CPU time and metrics."""
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.rl.local import train

    shutil.rmtree(out, ignore_errors=True)
    config = TrainConfig.from_dict(dict(
        model=str(model), data=[str(data)], reward=[f"{reward}:count_a"], algo="grpo",
        prompts_per_step=args.prompts, n_samples=args.n, max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch_size, steps=args.steps, lr=args.lr, kl_coef=args.kl_coef,
        temperature=1.0, top_p=1.0, out=str(out), progress=False, seed=args.seed, cpu_linear=args.cpu_linear))
    plugins = build_plugin_manager()
    clock = benchlib.StepClock()
    plugins.register(benchlib.step_clock_plugin(clock), name="benchmark_step_clock")
    clock.start()
    train(config, plugins=plugins)
    return clock


class BareLoop:
    """The same model work as one GRPO step, with nothing else."""

    def __init__(self, args, model_path: Path, data: Path):
        import json

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path)
        self.reference = None
        if args.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(model_path).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        prompts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()]
        self.prompt_ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        self.position = 0

    def logprobs(self, model, sequences, attention_mask, num_actions: int):
        logits = model(input_ids=sequences, attention_mask=attention_mask, logits_to_keep=num_actions + 1).logits
        logits = logits[:, :-1].float()  # (b, A, V)
        return logits.log_softmax(-1).gather(-1, sequences[:, -num_actions:, None]).squeeze(-1)  # (b, A)

    def step(self) -> dict[str, float]:
        import torch

        args, pad = self.args, self.tokenizer.pad_token_id
        batch = [self.prompt_ids[(self.position + i) % len(self.prompt_ids)] for i in range(args.prompts)]
        self.position += args.prompts
        rows = [ids for ids in batch for _ in range(args.n)]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # (B, P) left padded
        attention_mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
        started, cpu_started = time.perf_counter(), time.process_time()
        self.model.eval()
        with torch.no_grad():
            sequences = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                                            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                                            pad_token_id=pad)  # (B, P + A)
        num_actions = sequences.shape[1] - width
        full_mask = torch.cat([attention_mask, torch.ones_like(sequences[:, width:])], dim=1)  # (B, P + A)
        generated = time.perf_counter()
        mb = args.micro_batch_size
        if self.reference is not None:
            with torch.no_grad():
                ref = torch.cat([self.logprobs(self.reference, sequences[i:i + mb], full_mask[i:i + mb], num_actions)
                                 for i in range(0, len(rows), mb)])  # (B, A)
        forwards = time.perf_counter()
        self.model.train()
        advantages = torch.randn(len(rows), 1)  # (B, 1)
        for i in range(0, len(rows), mb):
            logprobs = self.logprobs(self.model, sequences[i:i + mb], full_mask[i:i + mb], num_actions)  # (b, A)
            loss = -(torch.exp(logprobs - logprobs.detach()) * advantages[i:i + mb]).sum() / logprobs.numel()
            if self.reference is not None:
                delta = ref[i:i + mb] - logprobs
                loss = loss + args.kl_coef * (delta.exp() - 1 - delta).mean()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        done = time.perf_counter()
        return {"step": done - started, "cpu": time.process_time() - cpu_started, "generate": generated - started,
                "logprob_forwards": forwards - generated, "train": done - forwards,
                "tokens": float(num_actions * len(rows))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_step_arguments(parser, rounds=2, other="bare", kl_help="β; > 0 adds the reference forward on both sides")
    args = parser.parse_args()

    threads = benchlib.setup_environment(args.threads)
    import torch

    root = benchlib.work_dir(args.work_dir)
    model = benchlib.model_dir(args.model, root)
    data, reward = benchlib.write_task(root)
    print(benchlib.machine_line(threads))
    print(benchlib.cpu_linear_line(args.cpu_linear))
    print(f"model {args.model}  G={args.prompts} n={args.n} new tokens={args.max_new_tokens} "
          f"micro batch={args.micro_batch_size} beta={args.kl_coef}  {args.steps} steps x {args.rounds} rounds")

    ours, ours_cpu, ours_metrics, bare = [], [], [], []
    for round_ in range(args.rounds):
        torch.manual_seed(args.seed + round_)
        clock = our_steps(args, model, data, reward, root / "runs" / "step_floor")
        ours += benchlib.steady(clock.intervals)
        ours_cpu += benchlib.steady(clock.cpu_intervals)
        ours_metrics += benchlib.steady(clock.metrics)
        loop = BareLoop(args, model, data)
        bare += benchlib.steady([loop.step() for _ in range(args.steps)])
        print(f"round {round_ + 1}: ours {benchlib.median(benchlib.steady(clock.intervals)):.4f} s/step, "
              f"bare {benchlib.median([b['step'] for b in bare[-(args.steps - 1):]]):.4f} s/step", flush=True)

    med = benchlib.median
    ours_step, bare_step = med(ours), med([b["step"] for b in bare])
    ours_cpu_step, bare_cpu_step = med(ours_cpu), med([b["cpu"] for b in bare])
    print()
    print(f"{'ours, median s':<32}  {'bare, median s':<26}")
    for our_key, bare_key in (("time/rollout", "generate"), ("time/experience", "logprob_forwards"),
                              ("time/train", "train"), ("time/reward", None)):
        bare_value = f"{bare_key:<18}{med([b[bare_key] for b in bare]):8.4f}" if bare_key else ""
        print(f"  {our_key:<22}{med([m[our_key] for m in ours_metrics]):8.4f}    {bare_value}")
    print(f"  {'time/step (metric)':<22}{med([m['time/step'] for m in ours_metrics]):8.4f}")
    print(f"  {'step, wall clock':<22}{ours_step:8.4f}    {'step, wall clock':<18}{bare_step:8.4f}")
    print(f"  {'step, CPU time':<22}{ours_cpu_step:8.4f}    {'step, CPU time':<18}{bare_cpu_step:8.4f}")
    tokens = med([m["response/length_mean"] * args.prompts * args.n for m in ours_metrics])
    print(f"generated tokens per step: ours {tokens:.0f}, bare {med([b['tokens'] for b in bare]):.0f}")
    print(f"ratio ours / bare: {ours_step / bare_step:.3f} wall clock, {ours_cpu_step / bare_cpu_step:.3f} CPU time "
          "(goal <= 1.15)")
    rest = med([m["time/step"] - m["time/rollout"] for m in ours_metrics])
    bare_rest = med([b["step"] - b["generate"] for b in bare])
    print(f"everything but generation: ours {rest:.4f} s, bare {bare_rest:.4f} s, "
          f"ratio {rest / bare_rest:.3f} (wall clock)")


if __name__ == "__main__":
    main()
