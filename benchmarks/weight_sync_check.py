"""CPU time of --verify-weight-sync per sync, against the sync's own copy, on models built from a config.

What each path adds to a sync (rlhf/core/weight_check.py computes the checksums):

* ``vllm``: the worker checksums what each parameter's loaders are given (cast to its dtype) and
  each written parameter after loading (order-free checksums): two passes over the weights;
* ``ray object store``: the actor checksums what arrived and its copy after loading (positional);
* ``ray broadcast``: the sender checksums what it sent, the receiver its copy (positional), one pass each.

The copy a sync makes anyway (``load_state_dict`` of every tensor) is timed beside it. Models: the
tiny Llama of the tests (``examples/tiny_model.py``) and a Qwen2-shaped model of ~100M parameters
(hidden 768, 10 layers, 12 heads / 4 KV heads, MLP 2560, vocabulary 32,000, tied embeddings),
built from a config with random weights, in fp32 and bf16. One torch thread; CPU time of this
process (``time.process_time``), the median of ``--repeats``.

    python benchmarks/weight_sync_check.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchlib import machine_line  # noqa: E402
from rlhf.core.weight_check import checksum  # noqa: E402


def tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    return LlamaForCausalLM(config)


def qwen2_100m() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32_000, hidden_size=768, intermediate_size=2560, num_hidden_layers=10,
                         num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True,
                         max_position_embeddings=2048)
    return Qwen2ForCausalLM(config)


def cpu_seconds(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.process_time()
        work()
        times.append(time.process_time() - began)
    return statistics.median(times)


def measure(name: str, model: torch.nn.Module, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    model = model.to(dtype)
    sent = {key: value.detach().clone() for key, value in model.named_parameters()}
    params = sum(t.numel() for t in sent.values())
    copy = cpu_seconds(lambda: model.load_state_dict(sent, strict=False), repeats)
    order_free = cpu_seconds(lambda: [checksum(t) for t in sent.values()], repeats)
    positional = cpu_seconds(lambda: [checksum(t, positional=True) for t in sent.values()], repeats)
    row = {"model": name, "dtype": str(dtype).removeprefix("torch."), "params_m": params / 1e6,
           "copy_s": copy, "vllm_s": 2 * order_free, "ray_store_s": 2 * positional, "ray_broadcast_s": positional,
           "ns_per_param_order_free": order_free / params * 1e9, "ns_per_param_positional": positional / params * 1e9}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line(1))
    print("| model | dtype | params | the sync's copy | vllm check | ray object-store check | ray broadcast check "
          "(per side) | order-free ns/param | positional ns/param |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, build in (("tiny llama", tiny_model), ("qwen2-100m", qwen2_100m)):
        torch.manual_seed(0)
        model = build()
        for dtype in (torch.float32, torch.bfloat16):
            r = measure(name, model, dtype, args.repeats)
            ms = {key: f"{r[key] * 1e3:.1f} ms" for key in ("copy_s", "vllm_s", "ray_store_s", "ray_broadcast_s")}
            print(f"| {r['model']} | {r['dtype']} | {r['params_m']:.2f}M | {ms['copy_s']} | "
                  f"{ms['vllm_s']} | {ms['ray_store_s']} | {ms['ray_broadcast_s']} | "
                  f"{r['ns_per_param_order_free']:.2f} | {r['ns_per_param_positional']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
