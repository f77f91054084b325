"""Packed against padded training forwards on CPU: forward + backward of the per-token log-probs
(rlhf.core.logprobs.token_logprobs) over one batch of mixed-length sequences, in micro-batches
of rows (padded to the longest in each, sorted by length as the RL update does, or in data order
as the fit loop does) or packed into one row each (``--packing``). Alternating in one process;
median wall and CPU seconds per batch.

    python benchmarks/packing.py --model small --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import MODELS, machine_line, median, setup_environment  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=160)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    options = parser.parse_args()
    threads = setup_environment(options.threads)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.core.logprobs import token_logprobs
    from rlhf.fastpaths.packing import PackedModel

    hidden, layers, vocab = MODELS[options.model]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                         max_position_embeddings=4096, attn_implementation=options.attn)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(options.min_len, options.max_len + 1, (options.rows,), generator=generator).tolist()
    width = max(lengths)
    ids = torch.randint(3, vocab, (options.rows, width), generator=generator)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, T) right-padded
    actions = mask[:, 1:].float()  # (B, A) every next token learnt (SFT-like)
    print(machine_line(threads))
    print(f"model {options.model} ({options.attn}), {options.rows} rows of {options.min_len}-{options.max_len} tokens "
          f"({sum(lengths)} real, micro-batches of {options.micro_batch_size})")

    def run(order: list[int], packed: bool) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        forward = PackedModel(model) if packed else model
        for begin in range(0, len(order), options.micro_batch_size):
            rows = order[begin:begin + options.micro_batch_size]
            keep = max(lengths[r] for r in rows)
            logprobs, _ = token_logprobs(forward, ids[rows, :keep], mask[rows, :keep], actions[rows, :keep - 1])
            (logprobs * actions[rows, :keep - 1]).sum().backward()
        model.zero_grad()
        return time.perf_counter() - wall, time.process_time() - cpu

    data_order = list(range(options.rows))
    by_length = sorted(data_order, key=lambda r: lengths[r])
    cases = {"padded, data order": (data_order, False), "padded, sorted by length": (by_length, False),
             "packed": (data_order, True)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for round_ in range(options.rounds + 1):
        for name, (order, packed) in cases.items():
            result = run(order, packed)
            if round_:  # the first round warms up
                times[name].append(result)
    base = median([t[1] for t in times["padded, sorted by length"]])
    for name, values in times.items():
        cpu = median([t[1] for t in values])
        print(f"{name:26s} wall {median([t[0] for t in values]):.3f} s  CPU {cpu:.3f} s  "
              f"(CPU vs sorted padded {base / cpu:.2f}x)")
    print(f"load average after: {Path('/proc/loadavg').read_text().split()[0]}")


if __name__ == "__main__":
    main()
