"""Running rlhf commands inside a check's process, and the models and tasks they train on.

A check's commands run through rlhf's own entry point (`rlhf.cli.main.main`) in the check's
process, one after the other, so the process can read the GPU's peak memory of each run
(``torch.cuda.max_memory_allocated``, reset before every run) without any change to rlhf. The
run's ``metrics.jsonl`` gives the rest (rewards, losses, step times, tokens/s).
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Context:
    repo: Path
    work: Path  # this check's scratch folder
    cpu: bool  # the dry run: toy sizes on a CPU

    @property
    def precision(self) -> str:
        return "fp32" if self.cpu else "bf16"

    @property
    def device_args(self) -> list[str]:
        return ["--device", "cpu", "--dtype", "fp32"] if self.cpu else ["--device", "cuda", "--dtype", "bf16"]

    def example(self, *parts: str) -> str:
        return str(self.repo.joinpath("examples", *parts))


@dataclass(frozen=True)
class Run:
    label: str
    argv: list[str]  # arguments of `rlhf`, the subcommand first; holds --out

    @property
    def out(self) -> Path:
        return Path(self.argv[self.argv.index("--out") + 1])


@dataclass
class Outcome:
    label: str
    rc: int
    wall_s: float
    peak_alloc_gib: float | None  # None on a CPU
    peak_reserved_gib: float | None
    metrics: list[dict[str, Any]] = field(default_factory=list)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def execute(run: Run) -> Outcome:
    """``rlhf <run.argv>`` in this process: its exit code, wall time, peak GPU memory and metrics."""
    import torch

    from rlhf.cli.main import main

    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    print(f"[gpu kit] rlhf {' '.join(run.argv)}", flush=True)
    start = time.perf_counter()
    try:
        main(list(run.argv))
        code = 0
    except SystemExit as exc:  # click ends every command this way, 0 included
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    wall = time.perf_counter() - start
    alloc = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
    return Outcome(run.label, code, wall, alloc, reserved, read_jsonl(run.out / "metrics.jsonl"))


def build_llama(out: Path, *, hidden: int, layers: int, heads: int) -> Path:
    """A random-weight Llama with the byte-level tokenizer (320 tokens) whose end-of-sequence token
    lies outside the output vocabulary, as the benchmarks' models: every completion runs to the
    token budget, so each step does the same work and tokens/s means the same thing."""
    if (out / "config.json").is_file():
        return out
    from rlhf.plugin_kit.tiny_model import build_random_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_random_model(out, tokenizer=tokenizer, hidden=hidden, layers=layers, heads=heads)
    tokenizer.add_special_tokens({"eos_token": "<|never|>"})  # id = vocabulary size: never sampled
    tokenizer.save_pretrained(out)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((out / name).read_text())
        config["eos_token_id"] = tokenizer.eos_token_id
        (out / name).write_text(json.dumps(config, indent=2))
    return out


def parameter_count(model_dir: Path) -> int:
    """Parameters in a model directory's safetensors files (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():
                shape = weights.get_slice(name).get_shape()
                count = 1
                for size in shape:
                    count *= size
                total += count
    return total


def write_count_a_task(repo: Path, root: Path) -> tuple[Path, Path]:
    """The benchmarks' task (benchmarks/benchlib.py): prompts asking for a's and a reward file whose
    ``count_a_dense`` counts them (plus a tie-break under 0.1). A random-weight model climbs it within
    a few steps: it only has to write one byte more often."""
    from rlhf.core.plugin_host.references import import_object

    root.mkdir(parents=True, exist_ok=True)
    return import_object(f"{repo / 'benchmarks' / 'benchlib.py'}:write_task")(root)
