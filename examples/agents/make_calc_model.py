"""Build the calculator agent's tiny chat model and its data: two-digit products, which the model
cannot compute alone but can look up with the ``calc`` tool (examples/agents/calc.py).

Task: the user asks "23*47"; the answer is "1081". A 2-layer model with a few hundred supervised
steps cannot multiply, but it can copy: call the tool with the question's expression, then copy the
tool's result into its answer. The conversation, in the model's chat template (Hermes-style tool
calls, the tool list left out of the prompt to keep it short)::

    <|im_start|>user\\n23*47<|im_end|>\\n<|im_start|>assistant\\n
    <tool_call>{"name": "calc", "arguments": {"expression": "23*47"}}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n1081<|im_end|>\\n<|im_start|>assistant\\n1081<|im_end|>

Warm-up (supervised, plain torch, a few hundred steps): only ``--tool-share`` of the examples use the
tool; the others answer at once with a number of the right size, almost always wrong. So the warmed
model can use the tool but rarely does (sampled at temperature 1 it calls it about as often as it
saw it), and the agent's reward (1 for the right product) starts low. GRPO through the agent
endpoint teaches it to call the tool: ``rlhf train --agent examples/agents/calc.py:solve`` (the
README's command) raises the mean reward by well over 0.3 within 100 steps.

The tokenizer has no merges (bytes + special tokens), so every digit is one token, plus four added
tokens for the tool call's fixed text. Its EOS is ``<|im_end|>``, the template's end of turn.

Measured (seed 0): the warmed model calls the tool on 13% of held-out problems sampled at T = 1
(a right call 9%) and copies the tool's result 78% of the time (greedy); the RL command's mean reward
goes from about 0.1 to about 0.8 within 60 steps (seeds 0 and 1: first ten steps 0.10 and 0.14,
steps 50-60 0.75 and 0.74; about 40 s of CPU time for 60 steps).

Writes (deterministic for a given --seed: the shipped files are this script's output; offline, 2-3
minutes of CPU time on 2 cores, 230 steps of 32 conversations):
  examples/agents/calc-model/       LlamaConfig checkpoint + tokenizer
  examples/agents/data/train.jsonl  {"prompt": "23*47", "answer": "1081"} rows for RL
  examples/agents/data/eval.jsonl   held-out products

    python examples/agents/make_calc_model.py [--seed 0] [--steps 300] [--model-dir DIR] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ARGS_OPEN, ARGS_CLOSE = '{"name": "calc", "arguments": {"expression": "', '"}}'
# Hermes-style tool calls, arguments as JSON; the tool list is not rendered (one tool, learnt in the warm-up)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def question(a: int, b: int) -> str:
    return f"{a}*{b}"


def build_tokenizer():
    """Bytes, the chat's special tokens and the tool call's fixed pieces; EOS is ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + len(SPECIAL_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(["0123456789*"], trainer=trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|im_end|>",
                                 pad_token="<|pad|>", padding_side="left", clean_up_tokenization_spaces=False)
    hf.add_tokens([CALL_OPEN, CALL_CLOSE, ARGS_OPEN, ARGS_CLOSE])
    hf.chat_template = CHAT_TEMPLATE
    return hf


def conversation(a: int, b: int, *, tool: bool, rng: random.Random) -> list[tuple[str, bool]]:
    """The warm-up's text of one problem as (piece, trained) pairs: with the tool, or a direct guess."""
    asked = f"<|im_start|>user\n{question(a, b)}<|im_end|>\n<|im_start|>assistant\n"
    if not tool:
        guess = rng.randrange(100, 10_000) if a * b >= 1000 else rng.randrange(10, 1000)
        return [(asked, False), (f"{guess}<|im_end|>", True)]
    call = f"{CALL_OPEN}{ARGS_OPEN}{question(a, b)}{ARGS_CLOSE}{CALL_CLOSE}<|im_end|>"
    result = f"\n<|im_start|>tool\n{a * b}<|im_end|>\n<|im_start|>assistant\n"
    return [(asked, False), (call, True), (result, False), (f"{a * b}<|im_end|>", True)]


def check_template(tokenizer) -> None:
    """The warm-up's pieces are what the chat template renders (so RL sees what the warm-up taught)."""
    messages = [{"role": "user", "content": "23*47"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c0", "type": "function",
                     "function": {"name": "calc", "arguments": {"expression": "23*47"}}}]},
                {"role": "tool", "tool_call_id": "c0", "content": "1081"},
                {"role": "assistant", "content": "1081"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    pieces = "".join(piece for piece, _ in conversation(23, 47, tool=True, rng=random.Random(0))) + "\n"
    assert rendered == pieces, (rendered, pieces)


def batch(tokenizer, conversations: list[list[tuple[str, bool]]]):
    """Right-padded ids and the loss mask (1 on the assistant's tokens)."""
    import torch

    rows, masks = [], []
    for pieces in conversations:
        ids, mask = [], []
        for text, trained in pieces:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [int(trained)] * len(piece)
        rows.append(ids)
        masks.append(mask)
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id)  # (B, T)
    attention = torch.zeros(len(rows), length, dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros(len(rows), length)  # (B, T)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        input_ids[i, :len(row)], attention[i, :len(row)] = torch.tensor(row), 1
        loss_mask[i, :len(row)] = torch.tensor(mask, dtype=torch.float)
    return input_ids, attention, loss_mask


def warm_up(model, tokenizer, pairs, *, steps: int, batch_size: int, lr: float, tool_share: float, seed: int,
            late_steps: int = 0, late_tool_share: float = 0.0, verbose: bool = False) -> None:
    """Next-token training on the assistant's turns: ``steps`` with ``tool_share`` of the problems using
    the tool (it learns the call and to copy), then ``late_steps`` with ``late_tool_share`` (it learns to
    prefer guessing)."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps + late_steps):
        share = tool_share if step < steps else late_tool_share
        chunk = [rng.choice(pairs) for _ in range(batch_size)]
        input_ids, attention, loss_mask = batch(tokenizer, [conversation(a, b, tool=rng.random() < share, rng=rng)
                                                           for a, b in chunk])
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]  # (B, T-1, V)
        nll = F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")  # (B, T-1)
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % 50 == 0 or step + 1 in (steps, steps + late_steps):
            progress = f"  {behaviour(model.eval(), tokenizer, pairs[:100])}" if verbose else ""
            model.train()
            print(f"warm-up step {step + 1:4d}/{steps + late_steps}  loss {loss.item():.3f}{progress}", flush=True)
    model.eval()


def behaviour(model, tokenizer, pairs) -> str:
    """Sampled at temperature 1: how often the model calls the tool, how often the call is right, and
    (greedy) how often it answers right once given the tool's result."""
    import torch

    def complete(texts: list[str], tokens: int, sample: bool) -> list[str]:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=tokens, do_sample=sample, top_k=0, top_p=1.0, temperature=1.0,
                                 pad_token_id=tokenizer.pad_token_id)
        return tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=False)

    torch.manual_seed(0)
    pieces = [conversation(a, b, tool=True, rng=random.Random(0)) for a, b in pairs]
    calls = complete([p[0][0] for p in pieces], 12, True)
    called = sum(c.startswith(CALL_OPEN) for c in calls) / len(pairs)
    right_call = sum(c.startswith(p[1][0]) for c, p in zip(calls, pieces)) / len(pairs)
    answers = complete(["".join(piece for piece, _ in p[:3]) for p in pieces], 6, False)
    copied = sum(answer.startswith(p[3][0]) for answer, p in zip(answers, pieces)) / len(pairs)
    return f"calls the tool {called:.2f}, right call {right_call:.2f}, copies its result {copied:.2f}"


def write_jsonl(path: Path, pairs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": question(a, b), "answer": str(a * b)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=HERE / "calc-model")
    parser.add_argument("--data-dir", type=Path, default=HERE / "data")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200, help="warm-up steps that mostly use the tool")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tool-share", type=float, default=0.8, help="share of those problems that use the tool")
    parser.add_argument("--late-steps", type=int, default=30, help="warm-up steps after them that mostly guess")
    parser.add_argument("--late-tool-share", type=float, default=0.1, help="share of those that use the tool")
    parser.add_argument("-v", "--verbose", action="store_true", help="score the copying while warming up")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.plugin_kit.tiny_model import build_random_model

    torch.set_num_threads(args.threads)
    start = time.process_time()
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(args.seed).shuffle(pairs)
    eval_pairs, train_pairs = pairs[:200], pairs[200:2200]
    tokenizer = build_tokenizer()
    check_template(tokenizer)
    build_random_model(args.model_dir, tokenizer=tokenizer, hidden=args.hidden, layers=args.layers,
                       max_positions=128, seed=args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    warm_up(model, tokenizer, pairs[200:], steps=args.steps, batch_size=args.batch_size, lr=args.lr,
            tool_share=args.tool_share, late_steps=args.late_steps, late_tool_share=args.late_tool_share,
            seed=args.seed, verbose=args.verbose)
    model.save_pretrained(args.model_dir)
    write_jsonl(args.data_dir / "train.jsonl", train_pairs)
    write_jsonl(args.data_dir / "eval.jsonl", eval_pairs)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters -> {args.model_dir}; "
          f"held-out: {behaviour(model, tokenizer, eval_pairs[:100])}")
    print(f"data: {len(train_pairs)} train, {len(eval_pairs)} held-out rows -> {args.data_dir}")
    print(f"took {time.process_time() - start:.0f} s of CPU time")


if __name__ == "__main__":
    main()
