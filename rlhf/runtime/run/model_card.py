"""The model card: ``README.md`` in ``final/`` and ``best/``, saying what the model is and how it was
made: the base model, the method (algorithm and its parts, or objective), the data, the command,
the steps, the key metrics at that point, the prompt format and, for an adapter in peft's format
(whichever model adapter wrote it), how to load it (instead of peft's empty template).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from rlhf.version import __version__

# The metrics a card shows when the run logged them (then every eval/* metric), in this order.
KEY_METRICS = ("reward/mean", "kl/mean", "response/length_mean", "policy/loss", "critic/loss", "train/loss",
               "train/acc", "train/accuracy", "train/reward_margin")


def command_line(command: str, out: Path) -> str:
    """The command that made the run: this process's own when it is the ``rlhf`` command, else the
    equivalent rerun from the run's config.yaml."""
    program = Path(sys.argv[0]).name if sys.argv else ""
    if program == "rlhf" or (program == "__main__.py" and "rlhf" in sys.argv[0]):
        return shlex.join(["rlhf", *sys.argv[1:]])
    return f"rlhf {command} --config {out / 'config.yaml'}"


def model_card(config: dict[str, Any], *, command: str, step: int, total_steps: int, metrics: dict[str, float],
               out: Path, method: str | None = None, best: str | None = None) -> str:
    """The card's Markdown. ``config``: the run's config as config.yaml holds it; ``metrics``: the
    values at ``step`` (the last step's and the last eval's); ``method``: how the loop names what
    it trained with (default: the objective or ``--algo``); ``best``: the metric that made this
    the best model (for ``best/``)."""
    method = method or (f"`{config['objective']}` (offline objective)" if config.get("objective")
                        else f"`{config.get('algo')}` (RL)")
    data = ", ".join(f"`{d}`" for d in config.get("data") or []) or "-"
    rewards = ", ".join(f"`{r}`" for r in config.get("reward") or [])
    if config.get("apply_chat_template"):
        prompt_format = "the tokenizer's chat template"
    elif config.get("input_template"):
        prompt_format = f"the input template `{config['input_template']!r}`"
    else:
        prompt_format = "plain prompts, no chat template"
    lines = [f"# {out.parent.name}" + (f": the best model by `{best}`" if best else ""), "",
             f"`{out.name}/` of the run in `{out.parent}`, trained with rlhf {__version__}.", "",
             "| | |", "|---|---|",
             f"| base model | `{config.get('model')}` |",
             f"| method | {method} |",
             f"| data | {data} |"]
    if rewards:
        lines.append(f"| rewards | {rewards} |")
    lines += [f"| steps | {step} of {total_steps} |",
              f"| prompt format | {prompt_format} (recorded in `prompt_format.json`) |",
              f"| seed | {config.get('seed')} |", ""]
    shown = [k for k in KEY_METRICS if k in metrics] + sorted(k for k in metrics if k.startswith("eval/"))
    if shown:
        lines += [f"Metrics at step {step}:", "", "| metric | value |", "|---|---|"]
        lines += [f"| `{k}` | {metrics[k]:.4g} |" for k in shown if isinstance(metrics[k], (int, float))]
        lines.append("")
    lines += ["Made by:", "", "```", command_line(command, out.parent), "```", "",
              "Every option of the run is in its `config.yaml`; `metrics.jsonl` holds every step."]
    return "\n".join(lines) + "\n"


def export_notes(directory: Path) -> str:
    """What the card adds once the model is written to ``directory``: for an adapter in peft's format
    (``adapter_config.json``, whichever model adapter wrote it), what it is and how to load it."""
    try:
        adapter = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError):  # no adapter, or not peft's file: the card says nothing more
        return ""
    if not isinstance(adapter, dict):
        return ""
    kind = {"LORA": "LoRA"}.get(str(adapter.get("peft_type")), str(adapter.get("peft_type") or "peft"))
    rank = f" (rank {adapter['r']})" if adapter.get("r") else ""
    base = adapter.get("base_model_name_or_path")
    on = f" on `{base}`" if base else ""
    return (f"\nThis directory is a {kind} adapter{rank}{on}: `rlhf chat`, `rlhf generate` and peft's "
            "`PeftModel.from_pretrained` load it on its base model.\n")
