"""What one prompt's samples become in the output file: one function per mode (docs/generate.md).

* ``samples``: ``{"prompt", "completions": [...], "rewards": [...]}`` (rewards only when scored),
  plus ``"label"`` and every other column of the input row;
* ``best_of_n`` (rejection sampling): ``{"prompt", "response", "reward"}``, the highest-reward
  sample (the first of them on a tie);
* ``pairs``: ``{"prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"}``, the highest-
  vs the lowest-reward sample (first of each on ties); no row when every scored sample ties;
* ``conditional`` (conditional SFT, arXiv:2308.12050, OpenRLHF's ``csft``): ``{"prompt", "response",
  "reward"}`` whose prompt is ``--reward-template`` with ``{input}`` the prompt and ``{reward}``
  the score with two decimals; one sample drawn at random per prompt (seeded) or every sample.

A reward of ``None`` (the source abstained, or failed under ``--reward-on-error skip``) never wins
a selection; a prompt with no scored sample gets no row (counted as ``unscored``).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One prompt's samples, as the output rows need them."""

    prompt: Any  # as in the dataset: a string or chat messages
    completions: list[str]
    rewards: list[float | None] | None  # None when nothing scored them
    label: Any = None
    columns: dict[str, Any] = field(default_factory=dict)  # other input columns, by name
    index: int = 0  # the prompt's position in the data (seeds --conditional-rows prompt)


@dataclass(frozen=True)
class Selection:
    mode: str = "samples"  # samples, best_of_n, pairs, conditional
    reward_template: str = "{input} <rm_score>: {reward} "
    conditional_rows: str = "prompt"  # prompt or sample
    seed: int = 42
    has_label: bool = False  # write "label" in samples rows


def make_rows(sample: Sample, selection: Selection, skipped: Counter) -> list[dict[str, Any]]:
    """The output rows of one prompt; a prompt left out adds one to ``skipped[reason]``."""
    if selection.mode == "samples":
        return [samples_row(sample, selection.has_label)]
    scored = [(i, r) for i, r in enumerate(sample.rewards or []) if r is not None]
    if not scored:
        skipped["unscored"] += 1
        return []
    if selection.mode == "best_of_n":
        best = max(scored, key=lambda item: item[1])  # max returns the first of equal keys
        return [{"prompt": sample.prompt, "response": sample.completions[best[0]], "reward": best[1]}]
    if selection.mode == "pairs":
        best = max(scored, key=lambda item: item[1])
        worst = min(scored, key=lambda item: item[1])
        if not best[1] > worst[1]:
            skipped["ties"] += 1
            return []
        return [{"prompt": sample.prompt, "chosen": sample.completions[best[0]],
                 "rejected": sample.completions[worst[0]], "chosen_reward": best[1], "rejected_reward": worst[1]}]
    if selection.mode == "conditional":
        if selection.conditional_rows == "prompt":
            scored = [random.Random(selection.seed * 1_000_003 + sample.index).choice(scored)]
        return [{"prompt": with_score(sample.prompt, reward, selection.reward_template),
                 "response": sample.completions[i], "reward": reward} for i, reward in scored]
    raise ValueError(f"unknown output mode {selection.mode!r}")


def samples_row(sample: Sample, has_label: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"prompt": sample.prompt, "completions": list(sample.completions)}
    if sample.rewards is not None:
        row["rewards"] = list(sample.rewards)
    if has_label:
        row["label"] = sample.label
    return {**row, **{k: v for k, v in sample.columns.items() if k not in row}}


def with_score(prompt: Any, reward: float, template: str) -> Any:
    """The prompt carrying its score: a string through the template; chat messages get the
    template applied to their last user message (the chat template then formats them as usual)."""
    score = f"{float(reward):.2f}"
    fill = lambda text: template.replace("{reward}", score).replace("{input}", text)  # noqa: E731
    if isinstance(prompt, str):
        return fill(prompt)
    messages = [dict(m) for m in prompt]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"] or [len(messages) - 1]
    messages[users[-1]]["content"] = fill(str(messages[users[-1]]["content"]))
    return messages


def rewards_by_prompt(total: Sequence[float | None], n: int) -> list[list[float | None]]:
    """Flat per-sample rewards (prompt-major) -> one list of ``n`` per prompt."""
    assert len(total) % n == 0, f"{len(total)} rewards for groups of {n}"
    return [list(total[i:i + n]) for i in range(0, len(total), n)]
