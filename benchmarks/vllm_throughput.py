"""Generated tokens per second of rlhf's ``vllm`` rollout engine against standalone vLLM; prints the ratio.

Both sides generate from the same checkpoint, in the same dtype, with the same vLLM settings
(memory fraction, maximum length, prefix caching, eager mode, processed log-probs when
``--logprobs``), for the same token-id prompts: G prompts x n samples, temperature and top-p as
given, ``--max-new-tokens`` each. The benchmark models (benchlib.py) cannot emit EOS, so every
completion runs to the budget and both sides generate exactly G x n x max-new-tokens tokens.

* standalone: ``vllm.LLM(...).generate(prompts, SamplingParams(n=n, ...))``, vLLM's own fan-out;
* ours: ``VLLMEngine(policy, tokenizer, config).generate(prompts, n=n, params)``: rows repeated n
  times (prefix caching shares them), output conversion, the change check on the policy's weights,
  with vLLM's engine core in the calling process (standalone runs it in a process of its own).

The default model, ``small32k``, has head size 64; ``tiny`` has 16, which some of vLLM's attention
backends refuse.

Each side runs in a process of its own (one vLLM per process), alternating, ``--rounds`` timed
generations per process after one warm-up generation (CUDA graph capture, allocator). Reported:
median tokens/s per side and ours / standalone (goal: >= 0.95). A full weight sync from the policy
module is timed once per round on our side and printed next to it (not part of tokens/s).

Needs a CUDA GPU and vLLM (``pip install "rlhf-core[vllm]"``); ``--help`` works without them.

    python benchmarks/vllm_throughput.py [--model small32k|small|tiny|DIR] [--prompts 64] [--n 8]
        [--max-new-tokens 256] [--runs 2] [--rounds 3] [--logprobs]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--model", default="small32k", help="tiny, small, small32k (built on first use) or a directory")
    parser.add_argument("--work-dir", default=None, help="Where benchmark models are built (default: $TMPDIR)")
    parser.add_argument("--prompts", type=int, default=64, help="G, prompts per generation")
    parser.add_argument("--n", type=int, default=8, help="Samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--logprobs", action="store_true", help="Both sides return sampled tokens' log-probs")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--enforce-eager", action="store_true", help="Both sides without CUDA graphs")
    parser.add_argument("--runs", type=int, default=2, help="Processes per side, alternating")
    parser.add_argument("--rounds", type=int, default=3, help="Timed generations per process (after a warm-up)")
    parser.add_argument("--side", choices=("ours", "vllm"), help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def max_model_len(args: argparse.Namespace, prompts: list[list[int]]) -> int:
    return max(len(p) for p in prompts) + args.max_new_tokens


def token_prompts(model: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer(benchlib.PROMPT.format(i), add_special_tokens=False)["input_ids"] for i in range(count)]


def run_standalone(args: argparse.Namespace, model: Path, prompts: list[list[int]]) -> dict:
    import vllm

    extra = {"logprobs_mode": "processed_logprobs"} if args.logprobs else {}
    llm = vllm.LLM(model=str(model), dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                   max_model_len=max_model_len(args, prompts), enable_prefix_caching=True,
                   enforce_eager=args.enforce_eager, seed=0, **extra)
    sampling = vllm.SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                   max_tokens=args.max_new_tokens, logprobs=0 if args.logprobs else None)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]

    def generate() -> int:
        outputs = llm.generate(inputs, sampling, use_tqdm=False)
        return sum(len(c.token_ids) for out in outputs for c in out.outputs)

    return timed_rounds(args, generate)


def run_ours(args: argparse.Namespace, model: Path, prompts: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.core.protocols.rollout import SamplingParams
    from rlhf.plugins.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype)).cuda()
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = VLLMEngineConfig(dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                              max_model_len=max_model_len(args, prompts), enforce_eager=args.enforce_eager, seed=0)
    engine = VLLMEngine(policy, tokenizer, config)
    engine.load_weights(None)  # the first generation would push the weights; keep that out of the clock
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            return_logprobs=args.logprobs)
    syncs = []

    def generate() -> int:
        generations = engine.generate(prompts, n=args.n, params=params)
        return sum(len(g.token_ids) for g in generations)

    def after_round() -> None:
        engine.load_weights(None)
        syncs.append(engine.last_sync_seconds)

    result = timed_rounds(args, generate, after_round)
    result["sync_s"] = syncs
    return result


def timed_rounds(args: argparse.Namespace, generate, after_round=None) -> dict:
    import torch

    generate()  # warm-up: CUDA graphs, allocator, lazy initialisation
    tokens, seconds = [], []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        started = time.perf_counter()
        tokens.append(generate())
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        if after_round is not None:
            after_round()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": [t / s for t, s in zip(tokens, seconds)],
            "gpu": torch.cuda.get_device_name(0)}


def child(args: argparse.Namespace) -> None:
    model = benchlib.model_dir(args.model, benchlib.work_dir(args.work_dir))
    prompts = token_prompts(model, args.prompts)
    result = (run_ours if args.side == "ours" else run_standalone)(args, model, prompts)
    Path(args.json_out).write_text(json.dumps(result))


def main() -> None:
    args = parse_args()
    benchlib.setup_environment(None)
    if args.side:
        return child(args)
    try:
        import importlib.metadata

        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        sys.exit('vLLM is not installed: pip install "rlhf-core[vllm]" on a machine with a CUDA GPU')
    benchlib.model_dir(args.model, benchlib.work_dir(args.work_dir))  # build once, before the children
    forwarded = sys.argv[1:]
    results: dict[str, list[dict]] = {"ours": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for side in ("ours", "vllm"):
                out = Path(tmp) / f"{side}-{run}.json"
                subprocess.run([sys.executable, __file__, *forwarded, "--side", side, "--json-out", str(out)],
                               check=True)
                results[side].append(json.loads(out.read_text()))
    ours = [x for r in results["ours"] for x in r["tokens_per_s"]]
    theirs = [x for r in results["vllm"] for x in r["tokens_per_s"]]
    tokens = {r["tokens"][0] for side in results.values() for r in side}
    syncs = [x for r in results["ours"] for x in r["sync_s"]]
    print(benchlib.machine_line(0))
    print(f"vllm {vllm_version}, GPU {results['ours'][0]['gpu']}, model {args.model}, {args.dtype}, "
          f"G={args.prompts} x n={args.n} x {args.max_new_tokens} new tokens, temperature {args.temperature}, "
          f"top-p {args.top_p}, log-probs {'on' if args.logprobs else 'off'}, "
          f"{'eager' if args.enforce_eager else 'CUDA graphs'}")
    print(f"tokens per generation: {sorted(tokens)} (both sides must match)")
    print(f"standalone vLLM: {benchlib.median(theirs):10.0f} tokens/s (median of {len(theirs)})")
    print(f"rlhf vllm engine: {benchlib.median(ours):10.0f} tokens/s (median of {len(ours)})")
    print(f"ratio ours / standalone: {benchlib.median(ours) / benchlib.median(theirs):.3f}  (goal >= 0.95)")
    print(f"weight sync from the policy module: {benchlib.median(syncs):.3f} s (median of {len(syncs)})")


if __name__ == "__main__":
    main()
