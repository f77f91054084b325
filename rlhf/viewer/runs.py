"""The runs ``rlhf view`` shows: each a run directory, read through its logs only (docs/runs.md).

A run is addressed by its place in the command line (``0``, ``1``, ...), never by a path a page
sends: the server reads nothing but ``metrics.jsonl``, ``samples.jsonl``, ``tokens.jsonl`` and
``config.yaml`` of the directories it was given. A run directory from before ``tokens.jsonl``
(or with fields its rlhf did not write) opens as well: what is missing is shown as missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.viewer.logs import MetricRows, StepLines

# The curves drawn first, those a run logged (rlhf plot's choice, and the agent's and the async loop's).
CHART_METRICS = ("reward/mean", "kl/mean", "response/length_mean", "policy/loss", "train/loss",
                 "eval/reward/mean", "eval/pass@1", "eval/loss")
LOGS = ("metrics.jsonl", "samples.jsonl", "tokens.jsonl")
MAX_CONFIG_BYTES = 256 * 1024


@dataclass
class Run:
    path: Path
    name: str
    metrics: MetricRows = field(init=False)
    samples: StepLines = field(init=False)
    tokens: StepLines = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = MetricRows(self.path / "metrics.jsonl")
        self.samples = StepLines(self.path / "samples.jsonl")
        self.tokens = StepLines(self.path / "tokens.jsonl")

    def config_text(self) -> str:
        path = self.path / "config.yaml"
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                return handle.read(MAX_CONFIG_BYTES)
        except OSError:
            return ""

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "config": self.config_text(),
                "has_tokens": self.tokens.exists()}

    def steps(self) -> list[int]:
        """The steps a training row of metrics.jsonl names (step 0 is the eval before training)."""
        return sorted({int(row["step"]) for row in self.metrics.refresh() if row.get("step", 0) >= 1})

    def step(self, step: int) -> dict[str, Any]:
        """The samples of ``step`` (samples.jsonl's rows, in order) and the token records of those that have one."""
        samples = self.samples.rows(step)
        tokens = {int(row["sample"]): row for row in self.tokens.rows(step) if isinstance(row.get("sample"), int)}
        return {"step": step, "samples": samples, "tokens": {str(k): v for k, v in sorted(tokens.items())}}

    def same_prompt(self, prompt: str, limit: int = 400) -> list[dict[str, Any]]:
        """The samples of ``prompt`` at any step (the latest ``limit``): found as bytes, as the logger wrote them."""
        needle = b'"prompt": ' + json.dumps(prompt).encode()
        return [{key: row.get(key) for key in ("step", "group", "reward", "rewards", "completion", "outcome",
                                                "finish_reason", "completion_tokens")}
                for row in self.samples.find(needle, limit)]


def open_runs(paths: list[Path]) -> list[Run]:
    """The runs of ``paths``, each checked to be a run directory (a folder with one of its logs)."""
    runs = []
    for path in paths:
        path = Path(path)
        if not path.is_dir():
            raise ConfigError(f"{path} is not a folder: rlhf view reads run directories (rlhf train --out)")
        if not any((path / log).is_file() for log in LOGS):
            raise ConfigError(f"{path} holds no run logs ({', '.join(LOGS)}): is it a run directory?")
        runs.append(path.resolve())
    names = [p.name or str(p) for p in runs]
    named = [(f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else n) for p, n in zip(runs, names)]
    return [Run(path, name) for path, name in zip(runs, named)]
