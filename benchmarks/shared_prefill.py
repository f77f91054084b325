"""The rollout engine's shared prompt prefill: n samples per prompt with one prefill per prompt
(its KV cache repeated, the default of the direct decoder) against one prefill per sample (the
prompt repeated n times, as before), alternating in one process; median wall and CPU seconds.

    python benchmarks/shared_prefill.py --model small --prompt-tokens 256 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import machine_line, median, model_dir, setup_environment, work_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    options = parser.parse_args()
    threads = setup_environment(options.threads)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.core.protocols.rollout import SamplingParams
    from rlhf.plugins.engines.hf import HFEngine, HFEngineConfig

    path = model_dir(options.model, work_dir(None))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    engine = HFEngine(model, tokenizer, HFEngineConfig(decoder="direct"))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (options.prompt_tokens - 4 * i,), generator=generator).tolist()
               for i in range(options.prompts)]
    params = SamplingParams(max_new_tokens=options.max_new_tokens, temperature=1.0)
    print(machine_line(threads))
    print(f"model {options.model}: {options.prompts} prompts of ~{options.prompt_tokens} tokens x n={options.n}, "
          f"{options.max_new_tokens} new tokens")
    cases = {"shared prefill": lambda: engine.generate(prompts, n=options.n, params=params),
             "prefill per sample": lambda: engine.generate([p for p in prompts for _ in range(options.n)], n=1,
                                                           params=params)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for round_ in range(options.rounds + 1):
        for name, run in cases.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            if round_:
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    for name, values in times.items():
        print(f"{name:20s} wall {median([v[0] for v in values]):.3f} s  CPU {median([v[1] for v in values]):.3f} s")
    base, new = (median([v[1] for v in times[k]]) for k in ("prefill per sample", "shared prefill"))
    print(f"speed-up (CPU): {base / new:.2f}x; load average after: {Path('/proc/loadavg').read_text().split()[0]}")


if __name__ == "__main__":
    main()
