"""Run directories written by hand, as a run writes them, for the viewer's tests: no training."""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = "<script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned = 2\">"


def line(row: dict) -> str:
    return json.dumps(row) + "\n"


def agent_sample(step: int, group: int, reward: float) -> tuple[dict, dict]:
    """A two-turn agent sample (a tool call, the tool's answer, the final answer) and its token record."""
    pieces = ["<tool_call>", "calc", "(6*7)", "</tool_call>", "\n<|im_start|>tool\n", "42", "\n<|im_start|>assistant\n",
              "The", " answer", " is", " 42", "<|im_end|>"]
    origins = [["model", 4], ["template", 1], ["tool", 1], ["template", 1], ["model", 5]]
    mask = [1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]
    n = len(pieces)
    sample = {"step": step, "group": group, "prompt": "What is 6*7? Use the calculator.",
              "completion": "".join(pieces), "label": "42", "reward": reward, "rewards": {"env": reward},
              "finish_reason": "stop", "completion_tokens": sum(mask), "turns": 2, "outcome": "ok", "error": None,
              "token_origins": [["template", 5], *origins]}
    tokens = {"step": step, "sample": 0, "group": group, "ids": list(range(100, 100 + n)), "pieces": pieces,
              "mask": mask, "logprobs": [round(-0.1 * (j + 1), 4) for j in range(n)],
              "rollout_logprobs": [round(-0.1 * (j + 1) + (0.05 if m else 0.0), 4) if m else 0.0
                                   for j, m in enumerate(mask)],
              "advantages": [0.5 if m else 0.0 for m in mask], "kl": [0.01 * j if m else 0.0 for j, m in enumerate(mask)],
              "origins": origins, "versions": [[step - 1, 4], [-1, 3], [step - 1, 5]]}
    return sample, tokens


def write_run(root: Path, steps: int = 4, samples: int = 6, *, tokens: bool = True, script: bool = True) -> Path:
    """A small run: ``steps`` steps, ``samples`` samples a step in groups of 2 (sample 0 an agent's two
    turns with a token record; with ``script``, sample 1 of the last step holds markup)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("model: tiny\nalgo: grpo\nsteps: %d\n" % steps)
    metrics, rows, records = [], [], []
    metrics.append(line({"step": 0, "eval/reward/mean": 0.1}))
    for step in range(1, steps + 1):
        metrics.append(line({"step": step, "reward/mean": 0.2 * step, "kl/mean": 0.01 * step,
                             "response/length_mean": 10 + step, "policy/loss": 1.0 / step, "lr": 1e-3}))
        sample, record = agent_sample(step, 0, 1.0)
        rows.append(line(sample))
        records.append(line(record))
        for index in range(1, samples):
            text = SCRIPT if script and step == steps and index == 1 else f"answer {index} at step {step}"
            rows.append(line({"step": step, "group": index // 2, "prompt": f"prompt {index // 2}", "completion": text,
                              "label": None, "reward": round(index / samples, 3), "rewards": {"len": index / samples},
                              "finish_reason": "length" if index == 3 else "stop", "completion_tokens": index + 1,
                              "outcome": "failed" if index == 5 else "ok", "error": None}))
    (root / "metrics.jsonl").write_text("".join(metrics))
    (root / "samples.jsonl").write_text("".join(rows))
    if tokens:
        (root / "tokens.jsonl").write_text("".join(records))
    return root


def write_large_run(root: Path, steps: int = 10_000, samples: int = 100) -> Path:
    """``steps`` x ``samples`` sample rows (about 130 bytes each), written a step at a time."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("model: tiny\n")
    template = "".join(line({"step": 0, "group": i // 4, "prompt": f"prompt {i // 4} of this step",
                             "completion": f"completion {i}", "reward": i / samples, "outcome": "ok"})
                       for i in range(samples))
    head = '{"step": 0,'
    with open(root / "samples.jsonl", "w") as handle, open(root / "metrics.jsonl", "w") as metrics:
        for step in range(1, steps + 1):
            handle.write(template.replace(head, '{"step": %d,' % step))
            metrics.write(line({"step": step, "reward/mean": (step % 100) / 100, "kl/mean": step * 1e-5,
                                "response/length_mean": 20.0, "policy/loss": 0.5}))
    return root
