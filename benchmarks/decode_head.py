"""The lean decode's output layer three ways: the layer's own product, its weight laid out once
(`--engine.pack-head`), and blocks of W·hᵀ (`--engine.block-head`, on by default).

Two parts, one torch thread, CPU time of this process (the work done, whatever else runs):

* **products**: one decode step's output-layer product x·Wᵀ (B rows) for several vocabulary x
  hidden sizes, through MKL (``F.linear``) and oneDNN, each on the weight as it is and on the
  weight laid out once, with the cost of laying it out and the steps after which that pays, and
  MKL's product as blocks of W·hᵀ (`rlhf.fastpaths.blocked_head`, whether its bits are F.linear's);
* **decode**: the `hf` engine's whole sampled decode (prefill, lean steps, sampling) of
  ``--rows`` rows x ``--tokens`` tokens on a benchlib model, the three alternating over
  ``--rounds``, for ``--cpu-linear torch`` (MKL) and ``onednn``; the sampled tokens are compared
  (the same seed: equal unless a float-rounding difference flips a draw).

    python benchmarks/decode_head.py [--model vocab152k] [--rows 32] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


def cpu_ms(call, repeat: int) -> float:
    call()
    start = time.process_time()
    for _ in range(repeat):
        call()
    return (time.process_time() - start) / repeat * 1e3


def products(rows: int) -> None:
    import torch

    from rlhf.fastpaths.blocked_head import BlockedHead
    from rlhf.fastpaths.cpu_linear import onednn_product

    print(f"products, {rows} rows: ms per call (MKL, MKL packed, MKL blocks of W·hᵀ, oneDNN, oneDNN packed), laying "
          "out (MKL / oneDNN), steps to pay it back")
    for vocab, hidden in ((32_000, 256), (32_000, 512), (32_000, 2048), (151_936, 512)):
        weight, x = torch.randn(vocab, hidden), torch.randn(rows, 1, hidden)
        repeat = max(3, int(2e9 / (vocab * hidden * rows * 2)))
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        dnn_packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        blocks = BlockedHead(SimpleNamespace(weight=weight))  # it reads only the layer's weight
        same = torch.equal(blocks(x), torch.nn.functional.linear(x, weight))
        t = dict(mkl=cpu_ms(lambda: torch.nn.functional.linear(x, weight), repeat),
                 blocked=cpu_ms(lambda: blocks(x), repeat),
                 mkl_packed=cpu_ms(lambda: torch.ops.mkl._mkl_linear(x, mkl_packed, weight, None, rows), repeat),
                 dnn=cpu_ms(lambda: onednn_product(x, weight), repeat),
                 dnn_packed=cpu_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, dnn_packed, None, "none", [], ""),
                                   repeat),
                 lay_mkl=cpu_ms(lambda: torch.ops.mkl._mkl_reorder_linear_weight(weight, rows), 3),
                 lay_dnn=cpu_ms(lambda: torch.ops.mkldnn._reorder_linear_weight(weight, rows), 3))

        def pays(lay: float, before: float, after: float) -> str:
            return f"{lay / (before - after):.0f}" if before > after else "never"

        print(f"  {vocab:>7,} x {hidden:<5} {t['mkl']:8.2f} {t['mkl_packed']:8.2f} ({t['mkl_packed'] / t['mkl']:.2f}x) "
              f"{t['blocked']:8.2f} ({t['blocked'] / t['mkl']:.2f}x, {'same bits' if same else 'other bits'}) "
              f"{t['dnn']:8.2f} {t['dnn_packed']:8.2f} ({t['dnn_packed'] / t['dnn']:.2f}x)   "
              f"{t['lay_mkl']:6.1f} / {t['lay_dnn']:6.1f}   {pays(t['lay_mkl'], t['mkl'], t['mkl_packed'])} / "
              f"{pays(t['lay_dnn'], t['dnn'], t['dnn_packed'])}")


def decode(model_name: str, rows: int, tokens: int, rounds: int, work: str | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.core.protocols.rollout import SamplingParams
    from rlhf.fastpaths.cpu_linear import use_onednn_linears
    from rlhf.plugins.engines.hf import HFEngine, HFEngineConfig

    directory = benchlib.model_dir(model_name, benchlib.work_dir(work))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompts = [tokenizer(benchlib.PROMPT.format(i))["input_ids"] for i in range(rows // 4)]
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    heads = {"own": HFEngineConfig(decoder="lean", block_head=False),
             "packed": HFEngineConfig(decoder="lean", block_head=False, pack_head=True),
             "blocked": HFEngineConfig(decoder="lean")}
    for linears in ("torch", "onednn"):
        engines = {}
        for name, config in heads.items():
            model = AutoModelForCausalLM.from_pretrained(directory).eval()
            use_onednn_linears(model, linears)
            engines[name] = HFEngine(model, tokenizer, config)
            engines[name].generate(prompts[:4], n=4, params=params)  # the lean variant's check, outside the clock
        times: dict[str, list[float]] = {name: [] for name in heads}
        samples = {}
        for _ in range(rounds):
            for name in heads:
                torch.manual_seed(0)
                start = time.process_time()
                samples[name] = [g.token_ids for g in engines[name].generate(prompts, n=4, params=params)]
                times[name].append(time.process_time() - start)
        own = statistics.median(times["own"])
        print(f"decode {model_name}, {len(prompts)} prompts x 4 = {rows} rows x {tokens} tokens, --cpu-linear {linears}: "
              + "; ".join(f"{name} {statistics.median(times[name]):.2f} s ({', '.join(f'{t:.2f}' for t in times[name])}, "
                          f"{statistics.median(times[name]) / own:.2f}x)" for name in heads)
              + f"; same tokens: {samples['own'] == samples['packed'] == samples['blocked']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vocab152k", help="a benchlib model name or a model directory")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-products", action="store_true")
    parser.add_argument("--work-dir", default=None, help="where benchlib builds its models")
    args = parser.parse_args()
    benchlib.setup_environment(1)
    print(benchlib.machine_line(1))
    if not args.skip_products:
        products(args.rows)
    decode(args.model, args.rows, args.tokens, args.rounds, args.work_dir)


if __name__ == "__main__":
    main()
