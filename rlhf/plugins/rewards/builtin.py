"""Small rule-based rewards (no dependencies), registered by ``rlhf.plugins.rewards.plugin``.

``exact_match``, ``regex_match`` and ``think_format`` score 1.0 or 0.0; a sample without a label
gets ``None`` (no score) from the label-based ones. The factories (`exact_match_reward`,
`regex_reward`) build configured variants for use from Python or a ``file.py:attr`` spec::

    # my_rewards.py, used as --reward my_rewards.py:answer_line
    from rlhf.plugins.rewards.builtin import exact_match_reward
    answer_line = exact_match_reward(extract=r"Answer:\\s*(.+)")

Completions may be strings or chat messages (TRL's conversational form); both are read as text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rlhf.plugins.rewards.math_answer import text_of

THINK_FORMAT = r"<think>(?:(?!<think>).)*?</think>\s*\S.*"


def _extract(text: str, pattern: re.Pattern[str] | None) -> str | None:
    if pattern is None:
        return text
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1) if pattern.groups else last.group(0)


def exact_match_reward(extract: str | None = None, *, ignore_case: bool = False,
                       name: str = "exact_match") -> Callable[..., list[float | None]]:
    """A reward: 1.0 when the (extracted) completion equals the label, both stripped.

    ``extract`` is a regex; its last match in the completion (group 1 when it has a group) is the
    answer, and a completion without a match scores 0.0.
    """
    pattern = re.compile(extract, re.DOTALL) if extract else None

    def reward(completions: list[Any], labels: list[Any]) -> list[float | None]:
        rewards: list[float | None] = []
        for completion, label in zip(completions, labels):
            if label is None:
                rewards.append(None)
                continue
            answer = _extract(text_of(completion), pattern)
            expected = str(label).strip()
            if answer is not None and ignore_case:
                answer, expected = answer.lower(), expected.lower()
            rewards.append(float(answer is not None and answer.strip() == expected))
        return rewards

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = exact_match_reward.__doc__.splitlines()[0].replace("A reward: ", "")
    return reward


def regex_reward(pattern: str, *, name: str = "regex_format") -> Callable[..., list[float]]:
    """A reward: 1.0 when the whole stripped completion matches ``pattern`` (``.`` matches newlines)."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: list[Any]) -> list[float]:
        return [float(compiled.fullmatch(text_of(c).strip()) is not None) for c in completions]

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"1.0 when the completion matches {pattern!r}."
    return reward


exact_match = exact_match_reward()
exact_match.__doc__ = "1.0 when the completion, stripped, equals the label, stripped; else 0.0."


def regex_match(completion: Any, label: Any) -> float | None:
    """1.0 when the whole stripped completion matches the label read as a regex; else 0.0."""
    if label is None:
        return None
    return float(re.fullmatch(str(label), text_of(completion).strip(), re.DOTALL) is not None)


think_format = regex_reward(THINK_FORMAT, name="think_format")
think_format.__doc__ = "1.0 for '<think>...</think>' followed by an answer (DeepSeek-R1's format); else 0.0."
