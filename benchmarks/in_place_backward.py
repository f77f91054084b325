"""CPU seconds of one policy micro-batch's backward with in-place gradients and with autograd adding them.

    python benchmarks/in_place_backward.py [--model vocab152k] [--repeats 6] [--work-dir DIR]

The model (a `benchlib` name, built once, or a directory) gets the tiled log-probs on two copies,
one of them with in-place gradients (rlhf/fastpaths/in_place_gradients.py); each runs a forward of
8 x 96 tokens and then its backward, into its ``.grad``, alternating (the order flipped every
round), one torch thread; the figure is the thread's CPU time of the backward alone. The first
backward of each copy (its ``.grad`` made, the in-place one's check against the plain gradient)
is left out.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vocab152k")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    benchlib.setup_environment(1)
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.core.logprobs import token_logprobs
    from rlhf.fastpaths.in_place_gradients import accumulating_in_place, use_in_place_gradients
    from rlhf.fastpaths.vocab_chunks import use_vocab_chunks

    path = benchlib.model_dir(args.model, benchlib.work_dir(args.work_dir))
    in_place = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    autograd = copy.deepcopy(in_place)
    for model in (in_place, autograd):
        use_vocab_chunks(model)
    use_in_place_gradients(in_place)
    generator = torch.Generator().manual_seed(0)
    vocab = in_place.get_input_embeddings().weight.shape[0]
    ids = torch.randint(10, vocab, (8, 96), generator=generator)  # (B, T)
    mask = torch.ones_like(ids)  # (B, T)
    actions = torch.zeros(8, 95)  # (B, T - 1): the last 64 positions are the response
    actions[:, 31:] = 1

    def backward(model: torch.nn.Module, place: bool) -> float:
        logprobs, _ = token_logprobs(model, ids, mask, actions)  # (B, T - 1)
        loss = (logprobs * actions).sum()
        began = time.thread_time()
        with accumulating_in_place(model.parameters()) if place else torch.enable_grad():
            loss.backward()
        return time.thread_time() - began

    sides = {"in place": (in_place, True), "autograd": (autograd, False)}
    for model, place in sides.values():
        backward(model, place)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(args.repeats):
        for name in (list(sides) if round_ % 2 == 0 else list(reversed(sides))):
            seconds[name].append(backward(*sides[name]))
    print(benchlib.machine_line(1))
    for name, values in seconds.items():
        print(f"{name:9s} CPU s per backward: median {statistics.median(values):.3f} "
              f"(min-max {min(values):.3f}-{max(values):.3f}, {len(values)} backwards)")
    print(f"in place / autograd: {statistics.median(seconds['in place']) / statistics.median(seconds['autograd']):.3f}")


if __name__ == "__main__":
    main()
