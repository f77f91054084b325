"""Reward functions for the quickstart's toy task (two-number addition, see make_quickstart_model.py).

rlhf calls a reward function by its signature: it passes only the parameters the function
declares, taken from ``prompts``, ``completions``, ``labels``, ``queries`` and every dataset
column by name. ``completions`` are the decoded completions without the prompt and without
special tokens; ``labels`` are the dataset column named by ``--label-key``.

    rlhf train --algo grpo ... --label-key answer --reward examples/rewards.py:exact_match
"""

from __future__ import annotations


def exact_match(completions: list[str], labels: list, **kwargs) -> list[float]:
    """1.0 where the completion, stripped of surrounding whitespace, equals the label, else 0.0.

    Labels may be strings or numbers (compared as ``str(label).strip()``).
    """
    assert len(completions) == len(labels), f"{len(completions)} completions but {len(labels)} labels"
    return [float(completion.strip() == str(label).strip()) for completion, label in zip(completions, labels)]


def format_ok(completions: list[str], **kwargs) -> list[float]:
    """1.0 where the completion is a well-formed answer (digits only, after stripping), else 0.0.

    A partial-credit helper: combine it with a small weight, e.g.
    ``--reward examples/rewards.py:exact_match --reward examples/rewards.py:format_ok@0.1``.
    """
    return [float(completion.strip().isdigit()) for completion in completions]
