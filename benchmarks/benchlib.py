"""Shared pieces of the benchmarks: the models, the task, a step clock, and the machine line.

The models are random-weight Llamas from ``examples/tiny_model.py`` whose end-of-sequence token
is moved outside the output vocabulary (a new special token, id = vocab size): no completion can
end early, so every completion (ours, TRL's and the bare loop's) runs to the full generation
budget and all sides do the same work per step.

Not imported by rlhf or its tests; the scripts next to it put this folder on ``sys.path``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# name -> hidden size, layers, vocabulary (320: the byte-level BPE alone; more: filler tokens added)
MODELS = {"tiny": (64, 2, 320), "small": (256, 4, 320), "small32k": (256, 4, 32_000),
          "vocab152k": (512, 4, 151_936),
          # benchmarks/scale.py's axes: `small` at a long context and a large vocabulary, and two bigger models
          "small4k": (256, 4, 320), "small152k": (256, 4, 151_936),
          "llama100m": (768, 8, 32_000), "llama500m": (1280, 16, 32_000)}
TIED = {"vocab152k", "llama100m"}  # output layer tied to the input embedding, as in Qwen2's small models
# build_random_model's other settings where a model leaves its defaults (4 heads, 512 positions)
SHAPE = {"small4k": {"max_positions": 4096}, "llama100m": {"heads": 12}, "llama500m": {"heads": 20}}
PROMPT = "Say many a's please {}"
REWARD_SOURCE = (
    "def count_a(completions, **kwargs):\n"
    "    return [float(c.count('a')) for c in completions]\n"
    "\n\n"
    "def count_a_dense(completions, **kwargs):\n"
    "    # count_a plus a per-completion tie-break below 0.1: the samples of a prompt never all score\n"
    "    # alike, so no advantage is zero and every sample trains (count_a is 0 for most completions\n"
    "    # of a model that rarely writes an a, such as small32k's)\n"
    "    return [c.count('a') + (sum(map(ord, c)) % 1000) / 10_000 for c in completions]\n"
)
REWARDS = ("count_a", "count_a_dense")


def add_step_arguments(parser: Any, *, rounds: int, other: str, kl_help: str) -> None:
    """The options every step benchmark shares: the model, the step's shape, the runs."""
    parser.add_argument("--model", default="tiny",
                        help="tiny (h64/L2), small (h256/L4), small32k (h256/L4, 32k vocabulary), vocab152k "
                             "(h512/L4, Qwen2's 151,936-token vocabulary, tied output layer) or a model directory")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (G)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--kl-coef", type=float, default=0.0, help=kl_help)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first is dropped)")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"alternating rounds of ours, {other}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="models, task and run folders (default: a temp folder)")
    add_cpu_linear_argument(parser)


def add_cpu_linear_argument(parser: Any) -> None:
    parser.add_argument("--cpu-linear", choices=["auto", "onednn", "torch"], default="auto",
                        help="our side's --cpu-linear (torch: MKL's products, as TRL and the bare loop use)")


def cpu_linear_line(mode: str) -> str:
    """Which products our side's linear layers run (rlhf.fastpaths.cpu_linear)."""
    from rlhf.fastpaths.cpu_linear import onednn_pays

    onednn = mode == "onednn" or (mode == "auto" and onednn_pays())
    return f"rlhf's CPU linear layers: {'oneDNN' if onednn else 'torch default (MKL)'} (--cpu-linear {mode})"


def setup_environment(threads: int | None) -> int:
    """Offline settings before torch/transformers are imported; returns the torch thread count."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def work_dir(path: str | None) -> Path:
    out = Path(path) if path else Path(tempfile.gettempdir()) / "rlhf-benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    return out


def model_path(name: str, root: Path) -> Path:
    """Where `model_dir` builds a MODELS name (or the directory given by path); builds nothing."""
    if name not in MODELS:
        return Path(name)
    hidden, layers, vocab = MODELS[name]
    extra = "".join(f"-{key[0]}{value}" for key, value in sorted(SHAPE.get(name, {}).items()))
    return root / f"{name}-h{hidden}-l{layers}-v{vocab}{extra}{'-tied' if name in TIED else ''}-noeos"


def model_dir(name: str, root: Path) -> Path:
    """A name from MODELS (built once under ``root``) or a model directory given by path."""
    out = model_path(name, root)
    if name in MODELS and not (out / "config.json").is_file():
        hidden, layers, vocab = MODELS[name]
        shape = SHAPE.get(name, {})
        from rlhf.core.plugin_host.references import import_object

        tiny_model = f"{ROOT / 'examples' / 'tiny_model.py'}"
        tokenizer = import_object(f"{tiny_model}:build_tokenizer")()
        tokenizer.add_tokens([f"<w{i}>" for i in range(vocab - len(tokenizer))])  # a realistic vocabulary size
        import_object(f"{tiny_model}:build_random_model")(out, tokenizer=tokenizer, hidden=hidden, layers=layers,
                                                                  tied=name in TIED, **shape)
        tokenizer.add_special_tokens({"eos_token": "<|never|>"})  # id = vocab size: the model cannot sample it
        tokenizer.save_pretrained(out)
        for file in ("config.json", "generation_config.json"):
            config = json.loads((out / file).read_text())
            config["eos_token_id"] = tokenizer.eos_token_id
            (out / file).write_text(json.dumps(config, indent=2))
    return out


def write_task(root: Path, num_prompts: int = 64) -> tuple[Path, Path]:
    """A prompt file and a reward file (`REWARDS`: the count of the letter a, and the same with a
    tie-break that makes every sample's advantage nonzero) shared by every benchmark."""
    data, reward = root / "prompts.jsonl", root / "count_a.py"
    data.write_text("".join(json.dumps({"prompt": PROMPT.format(i)}) + "\n" for i in range(num_prompts)))
    reward.write_text(REWARD_SOURCE)
    return data, reward


class StepClock:
    """Stamps the wall clock and this process's CPU time at the start and at every step end.

    Register it on a PluginSet with `step_clock_plugin` (rlhf's ``on_step_end``) or call
    ``stamp()`` from another framework's callback. CPU time is the robust figure on a busy
    machine with one torch thread: other processes do not inflate it.
    """

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.metrics: list[dict[str, Any]] = []

    def start(self) -> None:
        self.wall, self.cpu, self.metrics = [time.perf_counter()], [time.process_time()], []

    def stamp(self, metrics: dict[str, Any] | None = None) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.metrics.append(dict(metrics or {}))

    @property
    def intervals(self) -> list[float]:
        """Wall seconds of each step, end to end (the first one includes the warm-up)."""
        return [b - a for a, b in zip(self.wall, self.wall[1:])]

    @property
    def cpu_intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.cpu, self.cpu[1:])]


def step_clock_plugin(clock: StepClock) -> Any:
    import types

    import rlhf

    def on_step_end(run: Any, step: int, metrics: dict[str, Any]) -> None:
        clock.stamp(metrics)

    module = types.ModuleType("benchmark_step_clock")
    module.on_step_end = rlhf.hookimpl(on_step_end)
    return module


def steady(values: list[float]) -> list[float]:
    """Drop the first step (allocator warm-up, lazy imports)."""
    return values[1:] if len(values) > 1 else values


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def versions() -> dict[str, str]:
    found = {}
    for dist in ("torch", "transformers", "trl", "rlhf-core"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def machine_line(threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    found = " ".join(f"{k} {v}" for k, v in versions().items())
    return (f"{time.strftime('%Y-%m-%d')}  {cpu}, {os.cpu_count()} cores, torch threads {threads}, "
            f"load average {load}\n{found}, python {platform.python_version()}")
