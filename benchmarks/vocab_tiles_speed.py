"""The policy update with vocabulary tiles against the full logits, alternating in one process.

One `PolicyWorker.fit` (GRPO, the token-mean PPO loss, micro-batches of 8) on a fixed batch of
8 prompts x 4 samples (12 + 64 random tokens) under two copies of the same model: one whose
output layer computes log-probs in tiles (`rlhf.fastpaths.vocab_chunks`, every call tiled) and
one with the model's full logits. Rounds alternate; the medians of this process's CPU time are
reported (one torch thread: the work done, whatever else runs on the machine).

``--layer-only K``: the output layer alone instead, log-probs of K positions (hidden 512, Qwen2's
vocabulary, random weights) and their backward, three ways: the full logits' ``log_softmax``, the
tiles, and the tiles' known-gradient path (`vocab_chunks._KnownGradientLogprobs`: the loss's
gradient announced before the forward, the backward done inside it, ∂W into ``.grad``).

    python benchmarks/vocab_tiles_speed.py [--model vocab152k] [--rounds 3] [--layer-only 512]
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
    parser.add_argument("--model", default="vocab152k", help="a benchlib model name or a model directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--layer-only", type=int, default=0, metavar="K", help="the output layer alone, K positions")
    args = parser.parse_args()
    benchlib.setup_environment(1)
    if args.layer_only:
        return layer_only(args.layer_only, args.rounds)
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.algorithms import resolve_algorithm
    from rlhf.core.batch import collate
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.core.types import Trajectory
    from rlhf.fastpaths import vocab_chunks
    from rlhf.fastpaths.cpu_linear import use_onednn_linears
    from rlhf.plugins.backends.config import BackendConfig
    from rlhf.plugins.backends.torch_backend import TorchBackend
    from rlhf.runtime.rl.workers import PolicyWorker
    from rlhf.runtime.step.micro_batches import UpdateSettings

    vocab_chunks.FULL_LOGITS_UP_TO = 0  # every call in tiles
    model = AutoModelForCausalLM.from_pretrained(benchlib.model_dir(args.model, benchlib.work_dir(args.work_dir)))
    use_onednn_linears(model, "auto")
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    trajectories = []
    for group in range(8):
        prompt = torch.randint(5, vocab - 1, (12,), generator=generator).tolist()
        for _ in range(4):
            completion = torch.randint(5, vocab - 1, (64,), generator=generator).tolist()
            trajectories.append(Trajectory(token_ids=prompt + completion, loss_mask=[0] * 12 + [1] * 64,
                                           prompt_length=12, prompt="", prompt_text="", completion_text="",
                                           group=group))
    batch = collate(trajectories, pad_token_id=0, rewards=torch.zeros(32), sample_mask=torch.ones(32))
    batch.advantages = torch.randn(batch.action_mask.shape, generator=generator) * batch.action_mask  # (B, A)
    batch.returns = torch.zeros_like(batch.action_mask)  # (B, A)
    algo = resolve_algorithm("grpo", n_samples=4, kl_coef=0.0, plugins=build_plugin_manager(load_entrypoints=False))
    workers = {}
    for name in ("full logits", "tiles"):
        copied = copy.deepcopy(model)
        if name == "tiles":
            assert vocab_chunks.use_vocab_chunks(copied)
        settings = UpdateSettings(train_batch_size=32, micro_batch_size=8, max_new_tokens=64, share_prompt=True)
        workers[name] = PolicyWorker(copied, TorchBackend(copied, BackendConfig(lr=1e-6)), settings,
                                     algo.policy_training_loss(None, entropy_coef=0.0))
    print(benchlib.machine_line(1))
    seconds: dict[str, list[float]] = {name: [] for name in workers}
    for round_ in range(args.rounds):
        for name, worker in workers.items():
            began = time.process_time()
            worker.fit(batch, step=round_)
            seconds[name].append(time.process_time() - began)
            print(f"round {round_ + 1} {name:>11}: {seconds[name][-1]:.2f} s CPU", flush=True)
    full, tiles = statistics.median(seconds["full logits"]), statistics.median(seconds["tiles"])
    print(f"policy update, CPU s: full logits {full:.2f}, tiles {tiles:.2f}: {tiles / full:.2f}x")


def layer_only(positions: int, rounds: int, hidden_size: int = 512, vocab: int = 151_936) -> None:
    """Log-probs of ``positions`` positions and their backward (h and W), both ways, alternating."""
    import torch

    from rlhf.fastpaths import vocab_chunks
    from rlhf.fastpaths.in_place_gradients import accumulating_in_place

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.02).requires_grad_()  # (V, H)
    hidden = torch.randn(positions, hidden_size, generator=generator)  # (K, H)
    targets = torch.randint(0, vocab, (positions,), generator=generator)  # (K,)
    weights = torch.randn(positions, generator=generator)  # (K,) the loss's gradient

    def full_logits() -> None:
        h = hidden.clone().requires_grad_()
        log_p = torch.log_softmax(torch.nn.functional.linear(h, weight), dim=-1)  # (K, V)
        (log_p.gather(-1, targets[:, None]).squeeze(-1) * weights).sum().backward()

    def tiles() -> None:
        h = hidden.clone().requires_grad_()
        logprobs, _ = vocab_chunks._ChunkedLogprobs.apply(h, weight, None, targets, 1.0, False, False)  # (K,)
        (logprobs * weights).sum().backward()

    def known() -> None:
        h = hidden.clone().requires_grad_()
        with accumulating_in_place([weight]):
            logprobs = vocab_chunks._KnownGradientLogprobs.apply(h, weight, targets, weights, 1.0, False, owner)
            (logprobs * weights).sum().backward()

    owner = torch.nn.Module()
    h = hidden.clone().requires_grad_()
    logprobs, _ = vocab_chunks._ChunkedLogprobs.apply(h, weight, None, targets, 1.0, False, False)  # (K,)
    (logprobs * weights).sum().backward()
    tiled = (logprobs.detach(), h.grad, weight.grad)
    weight.grad = None
    h = hidden.clone().requires_grad_()
    with accumulating_in_place([weight]):
        logprobs = vocab_chunks._KnownGradientLogprobs.apply(h, weight, targets, weights, 1.0, False, owner)
        (logprobs * weights).sum().backward()
    print("known gradient against the tiles, largest difference relative to the largest entry: " + ", ".join(
        f"{name} {float((a - b).abs().max() / b.abs().max()):.1e}" for name, a, b in zip(
            ("log-probs", "dL/dh", "dL/dW"), (logprobs.detach(), h.grad, weight.grad), tiled)))
    print(benchlib.machine_line(1))
    runs = (("full logits", full_logits), ("tiles", tiles), ("known gradient", known))
    seconds: dict[str, list[float]] = {name: [] for name, _ in runs}
    for round_ in range(rounds):
        for name, run in runs:
            weight.grad = None
            began = time.process_time()
            run()
            seconds[name].append(time.process_time() - began)
            print(f"round {round_ + 1} {name:>14}: {seconds[name][-1]:.2f} s CPU", flush=True)
    full, tiled_s, known_s = (statistics.median(seconds[name]) for name, _ in runs)
    print(f"output layer, {positions} positions, CPU s: full logits {full:.2f}, tiles {tiled_s:.2f} "
          f"({tiled_s / full:.2f}x), known gradient {known_s:.2f} ({known_s / tiled_s:.2f}x the tiles)")


if __name__ == "__main__":
    main()
