"""The largest model this machine trains: GRPO steps on Qwen2.5-0.5B- and -1.5B-shaped random models.

Each model is built from its architecture alone (random weights, no download: Qwen2, hidden 896 x
24 layers and 1536 x 28, 151,936-token vocabulary, tied output layer, grouped-query attention with
2 key/value heads), with the repository's byte-level tokenizer padded to the full vocabulary.
Each setting runs ``rlhf train --algo grpo`` through the real CLI in its own process (2 prompts x
4 samples, 32 new tokens, micro-batch 4, no reference model, 2 steps, one torch thread) and reports
the process's peak resident set (the child's ``ru_maxrss``) and the second step's wall and CPU
time (``time/step`` of metrics.jsonl; the first step pays the one-time checks).

The settings: LoRA (rank 16), full fine-tuning on the torch backend, DeepSpeed ZeRO-3 with the
optimizer and parameters offloaded, each with and without ``--gradient-checkpointing``. A setting
whose weights, gradients and AdamW moments alone (16 bytes a parameter in float32) exceed the
machine's memory is not started: it is reported with that figure instead of swapping the machine.

    python benchmarks/largest_model.py [--models qwen0.5b,qwen1.5b] [--settings lora,full,zero3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

# name -> Qwen2 architecture (hidden, layers, intermediate, attention heads, key/value heads)
QWEN = {"qwen0.5b": (896, 24, 4864, 14, 2), "qwen1.5b": (1536, 28, 8960, 12, 2)}
VOCAB = 151_936
SETTINGS = {
    "lora": ["--lora-rank", "16", "--lora-alpha", "32"],
    "full": ["--backend", "torch"],
    "full-bf16": ["--backend", "torch", "--dtype", "bf16"],
    "zero3": ["--backend", "deepspeed", "--zero-stage", "3", "--offload-optimizer", "--offload-params"],
}
# bytes a parameter for weights + gradients + AdamW's two moments (float32; bfloat16 for full-bf16, whose
# optimizer keeps its moments in the parameters' dtype); LoRA trains ~0.1% of the parameters
STATE_BYTES = {"lora": 4, "full": 16, "full-bf16": 8, "zero3": 16}


def build_qwen(name: str, root: Path) -> Path:
    """A random Qwen2 model with ``name``'s architecture, saved once under ``root``."""
    out = root / f"{name}-random"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf.plugin_kit.tiny_model import build_tokenizer

    hidden, layers, intermediate, heads, kv_heads = QWEN[name]
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([f"<w{i}>" for i in range(VOCAB - len(tokenizer))])
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, rope_theta=1_000_000.0, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def parameter_count(name: str) -> int:
    hidden, layers, intermediate, heads, kv_heads = QWEN[name]
    head_dim = hidden // heads
    attention = hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim + hidden + 2 * kv_heads * head_dim
    mlp = 3 * hidden * intermediate
    return VOCAB * hidden + layers * (attention + mlp + 2 * hidden) + hidden


def machine_memory_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def run_one(model: Path, setting: str, checkpointing: bool, root: Path, args: argparse.Namespace) -> dict:
    """One ``rlhf train`` process; its peak RSS and the last step's times."""
    data, reward = benchlib.write_task(root)
    out = root / "runs" / f"{model.name}-{setting}{'-gc' if checkpointing else ''}"
    command = [sys.executable, "-m", "rlhf", "train", "--model", str(model), "--data", str(data),
               "--reward", f"{reward}:count_a_dense", "--algo", "grpo", "--kl-coef", "0",
               "--prompts-per-step", str(args.prompts), "--n-samples", str(args.n),
               "--max-new-tokens", str(args.max_new_tokens), "--micro-batch-size", str(args.micro_batch_size),
               "--steps", str(args.steps), "--lr", "1e-5", "--out", str(out), "--no-progress",
               *SETTINGS[setting], *(["--gradient-checkpointing"] if checkpointing else [])]
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, RLHF_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    started = time.perf_counter()
    # run through a fresh Python so that ru_maxrss of its children is this one run's peak
    probe = ("import resource, subprocess, sys, json; done = subprocess.run(sys.argv[1:], capture_output=True, "
             "text=True); print(json.dumps({'rc': done.returncode, 'peak_mb': (u := resource.getrusage("
             "resource.RUSAGE_CHILDREN)).ru_maxrss / 1024, 'cpu_s': u.ru_utime + u.ru_stime, 'stderr': done.stderr[-2000:]}))")
    done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    steps = [row for row in metrics if "time/step" in row]
    if steps:
        result["s_per_step"] = steps[-1]["time/step"]
        result["timings"] = {k: round(v, 2) for k, v in steps[-1].items() if k.startswith("time/")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen0.5b,qwen1.5b")
    parser.add_argument("--settings", default="lora,full,full-bf16,zero3")
    parser.add_argument("--checkpointing", default="off,on", help="off, on or both (off,on)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    benchlib.setup_environment(args.threads)
    root = benchlib.work_dir(args.work_dir)
    memory = machine_memory_mb()
    print(benchlib.machine_line(args.threads))
    print(f"GRPO, {args.prompts} prompts x {args.n} samples, {args.max_new_tokens} new tokens, micro-batch "
          f"{args.micro_batch_size}, {args.steps} steps; machine memory {memory:,.0f} MB")
    results = []
    for name in args.models.split(","):
        params = parameter_count(name)
        model = build_qwen(name, root)
        for setting in args.settings.split(","):
            for checkpointing in [c == "on" for c in args.checkpointing.split(",")]:
                row = {"model": name, "params_m": round(params / 1e6, 1), "setting": setting,
                       "gradient_checkpointing": checkpointing}
                needed = params * STATE_BYTES[setting] / 2**20
                if needed > 0.9 * memory:
                    row.update(skipped=f"weights, gradients and AdamW need {needed:,.0f} MB > 90% of "
                                       f"{memory:,.0f} MB", rc=None)
                else:
                    row.update(run_one(model, setting, checkpointing, root, args))
                results.append(row)
                shown = row.get("skipped") or (
                    f"peak {row['peak_mb']:,.0f} MB  {row.get('s_per_step', float('nan')):.1f} s/step"
                    if row["rc"] == 0 else f"failed (rc {row['rc']}): {row['stderr'][-300:]}")
                print(f"{name:9} {params / 1e6:6.0f}M  {setting:5} gc={'on ' if checkpointing else 'off'}  "
                      f"{shown}", flush=True)
                if args.json:  # after every setting: a run stopped half-way keeps what it measured
                    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
