"""Build the quickstart's tiny model and toy data: two-number addition, by a model that rambles.

Task: the prompt "23+45=" (plain text, no chat template), the answer "68". a and b run over
0..99, so there are 10,000 prompts, more than the warm-up can memorise: the model has to learn
to add (it does, on held-out prompts too). The tokenizer has no merges (bytes + special tokens),
so every digit is one token and the answer is written digit by digit.

Warm-up (supervised, plain torch): like a chatty base model's training text, the answers are
usually followed by a restatement, "68, so 45+23=68", and only sometimes end right after the
number. The warmed model adds correctly but, sampled at temperature 1.0, stops after the bare
number only about a third of the time; ``exact_match`` scores "68, so 45+23=68" as 0. GRPO with
that reward teaches it to answer with the number alone: with 16 prompts x 8 samples per step and
learning rate 1e-4, mean reward rises from about 0.35 to 0.95 in 50 steps, and completions
shrink from about 12 tokens to 3-4 (benchmarks/quickstart_grpo_check.py has the figures).

Warm-up choices, measured: the arithmetic "clicks" suddenly, after 300-600 steps of 64 examples
at learning rate 1e-3 (held-out greedy accuracy jumps from ~0.1 to ~0.9); 800 steps leave a
margin across seeds (0.97-1.0, 0.90, 0.95 for seeds 0, 1, 2). A peak rate of 2e-3 or 3e-3 is
unstable: some seeds never click. The rate stays constant instead of decaying to 0, because a
model trained to the bottom of a sharp valley is knocked off its arithmetic by the first Adam
steps of RL (a cosine-to-0 warm-up lost half its accuracy after one GRPO step at 1e-3).

Writes (deterministic for a given --seed, offline, about a minute on 2 CPU cores):
  examples/tiny-model/        LlamaConfig checkpoint + tokenizer (left padding, pad/eos set)
  examples/data/train.jsonl   {"prompt": "23+45=", "answer": "68"} rows for RL
  examples/data/eval.jsonl    held-out prompts, in neither the warm-up nor train.jsonl

    python examples/make_quickstart_model.py [--seed 0] [--model-dir DIR] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import SPECIAL_TOKENS, build_random_model, build_tokenizer

HERE = Path(__file__).resolve().parent
MAX_OPERAND = 99
BYTES_ONLY_VOCAB = 256 + len(SPECIAL_TOKENS)  # no BPE merges: one token per digit


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


def restatement(a: int, b: int) -> str:
    """What the warm-up data often says after the answer (and exact match does not accept)."""
    return f", so {b}+{a}={a + b}"


def split_problems(seed: int, n_eval: int, n_train: int) -> tuple[list[tuple[int, int]], ...]:
    """All (a, b) pairs shuffled: (held-out eval, RL train subset, warm-up = every non-eval pair)."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    eval_pairs, rest = pairs[:n_eval], pairs[n_eval:]
    return eval_pairs, rest[:n_train], rest


def sft_batch(encode, pad_id: int, eos_id: int, examples: list[tuple[str, str]]):
    """Right-padded ids and a loss mask on the completion tokens and <|eos|> (positions start at 0)."""
    import torch

    rows, masks = [], []
    for prompt, completion in examples:
        prompt_ids, completion_ids = list(encode(prompt)), [*encode(completion), eos_id]
        rows.append(prompt_ids + completion_ids)
        masks.append([0] * len(prompt_ids) + [1] * len(completion_ids))
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id)  # (B, T)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros(len(rows), length)  # (B, T)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        loss_mask[i, : len(row)] = torch.tensor(mask, dtype=torch.float)
    return input_ids, attention_mask, loss_mask


def warm_up(model, tokenizer, pairs, *, steps: int, batch_size: int, lr: float, ramble_prob: float, seed: int,
            log_every: int = 100, eval_pairs=None) -> None:
    """Next-token training on answers that ramble on with probability ``ramble_prob``.

    AdamW; the learning rate rises linearly over the first 5% of the steps, then stays at ``lr``.
    """
    import torch
    import torch.nn.functional as F

    rng = random.Random(seed)
    encode = functools.lru_cache(maxsize=None)(lambda text: tuple(tokenizer(text).input_ids))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    order: list[tuple[int, int]] = []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        if len(order) < batch_size:  # epochs over a fresh shuffle, so every pair is seen equally often
            order += rng.sample(pairs, len(pairs))
        chunk, order = order[:batch_size], order[batch_size:]
        examples = [(prompt_of(a, b), str(a + b) + (restatement(a, b) if rng.random() < ramble_prob else ""))
                    for a, b in chunk]
        input_ids, attention_mask, loss_mask = sft_batch(encode, tokenizer.pad_token_id, tokenizer.eos_token_id,
                                                         examples)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (B, T-1, V)
        nll = F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")  # (B, T-1)
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            progress = ""
            if eval_pairs:
                greedy = score(model.eval(), tokenizer, eval_pairs, sample=False)
                model.train()
                progress = f"  held-out greedy: sum right {greedy['sum_right']:.2f}"
            print(f"warm-up step {step + 1:4d}/{steps}  loss {loss.item():.3f}{progress}", flush=True)
    model.eval()


def score(model, tokenizer, pairs, *, sample: bool, seed: int = 0, max_new_tokens: int = 16) -> dict:
    """Exact match (the RL reward), a correct sum before any restatement, and ends-with-eos shares."""
    import torch

    torch.manual_seed(seed)
    enc = tokenizer([prompt_of(a, b) for a, b in pairs], return_tensors="pt", padding=True)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, **sampling)
    completion_ids = out[:, enc.input_ids.shape[1]:]  # (B, A)
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    sums = [str(a + b) for a, b in pairs]
    exact = [c.strip() == s for c, s in zip(completions, sums)]
    sum_right = [c.split(",")[0].strip() == s for c, s in zip(completions, sums)]
    ended = (completion_ids == tokenizer.eos_token_id).any(dim=1)  # (B,)
    return {"exact_match": sum(exact) / len(pairs), "sum_right": sum(sum_right) / len(pairs),
            "ends_with_eos": ended.float().mean().item()}


def write_jsonl(path: Path, pairs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": prompt_of(a, b), "answer": str(a + b)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=HERE / "tiny-model")
    parser.add_argument("--data-dir", type=Path, default=HERE / "data")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=800, help="warm-up optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="warm-up learning rate (constant after 5%% of the steps)")
    parser.add_argument("--ramble-prob", type=float, default=0.65,
                        help="share of warm-up answers followed by a restatement")
    parser.add_argument("--n-eval", type=int, default=500, help="held-out prompts (eval.jsonl)")
    parser.add_argument("--n-train", type=int, default=2000, help="RL prompts (train.jsonl)")
    parser.add_argument("-v", "--verbose", action="store_true", help="score held-out prompts while warming up")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    eval_pairs, train_pairs, warmup_pairs = split_problems(args.seed, args.n_eval, args.n_train)
    corpus = [prompt_of(a, b) + str(a + b) + restatement(a, b) for a, b in warmup_pairs]
    tokenizer = build_tokenizer(corpus, vocab_size=BYTES_ONLY_VOCAB)
    build_random_model(args.model_dir, tokenizer=tokenizer, hidden=args.hidden, layers=args.layers,
                       max_positions=64, seed=args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    warm_up(model, tokenizer, warmup_pairs, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
            ramble_prob=args.ramble_prob, seed=args.seed,
            eval_pairs=eval_pairs[:100] if args.verbose else None)
    model.save_pretrained(args.model_dir)
    write_jsonl(args.data_dir / "train.jsonl", train_pairs)
    write_jsonl(args.data_dir / "eval.jsonl", eval_pairs)

    sampled = score(model, tokenizer, eval_pairs, sample=True, seed=args.seed)
    greedy = score(model, tokenizer, eval_pairs, sample=False)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)} "
          f"-> {args.model_dir}")
    print(f"data: {len(train_pairs)} train, {len(eval_pairs)} held-out rows -> {args.data_dir}")
    print(f"held-out, sampled at T=1.0: exact match {sampled['exact_match']:.2f}, sum right "
          f"{sampled['sum_right']:.2f}, ends with eos {sampled['ends_with_eos']:.2f}; greedy: exact match "
          f"{greedy['exact_match']:.2f}, sum right {greedy['sum_right']:.2f}")
    print(f"took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
