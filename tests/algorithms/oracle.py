"""The math of docs/algorithms.md written the slow, obvious way: Python floats and loops, one sample at a time.

The property tests compare the vectorised estimators against this on random batches, so an error
in either shows up as a disagreement. (String switches are fine in a test oracle.)
"""

from __future__ import annotations

import math

GROUP = ("reinforce_pp_baseline", "rloo", "grpo", "dr_grpo")
WHITENED = ("gae", "reinforce_pp", "reinforce_pp_baseline")


def shaped_reward(name: str, rewards: list[float], i: int) -> float:
    """The shaped sequence reward of sample i of one group (all samples valid)."""
    n = len(rewards)
    r = rewards[i]
    mean = sum(rewards) / n
    if name in ("gae", "reinforce_pp"):
        return r
    if name in ("reinforce_pp_baseline", "dr_grpo"):
        return r - mean
    if name == "rloo":
        return r - (sum(rewards) - r) / (n - 1)
    if name == "grpo":
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / (n - 1))
        return (r - mean) / (std + 1e-9)
    raise AssertionError(name)


def advantages(name: str, rewards: list[float], mask: list[list[int]], n: int, *, values=None, kl=None,
               beta: float = 0.0, gamma: float = 1.0, lambd: float = 1.0, std_norm: bool = True,
               clip: float | None = 10.0) -> tuple[list[list[float]], list[list[float]]]:
    """(advantages, returns) as nested lists, 0 at masked positions."""
    batch, width = len(rewards), len(mask[0])
    if name in GROUP:
        gamma = 1.0
    adv = [[0.0] * width for _ in range(batch)]
    ret = [[0.0] * width for _ in range(batch)]
    for i in range(batch):
        start = (i // n) * n
        s = shaped_reward(name, rewards[start:start + n], i - start)
        if clip is not None:
            s = max(-clip, min(clip, s))
        positions = [t for t in range(width) if mask[i][t]]
        per_token = [0.0] * width
        for t in positions:
            per_token[t] = (-beta * kl[i][t] if kl is not None else 0.0) + (s if t == positions[-1] else 0.0)
        if name == "gae":
            v = [values[i][t] if mask[i][t] else 0.0 for t in range(width)] + [0.0]
            running = 0.0
            for t in reversed(range(width)):
                running = per_token[t] + gamma * v[t + 1] - v[t] + gamma * lambd * running
                adv[i][t] = running
                ret[i][t] = running + v[t]
        else:
            running = 0.0
            for t in reversed(range(width)):
                running = per_token[t] + gamma * running
                adv[i][t] = ret[i][t] = running
    cells = [(i, t) for i in range(batch) for t in range(width) if mask[i][t]]
    if name in WHITENED and cells:
        mean = sum(adv[i][t] for i, t in cells) / len(cells)
        var = sum((adv[i][t] - mean) ** 2 for i, t in cells) / len(cells)
        scale = 1 / math.sqrt(max(var, 1e-8)) if std_norm else 1.0
        adv = [[(a - mean) * scale for a in row] for row in adv]
    zero = [[a if mask[i][t] else 0.0 for t, a in enumerate(row)] for i, row in enumerate(adv)]
    ret = [[a if mask[i][t] else 0.0 for t, a in enumerate(row)] for i, row in enumerate(ret)]
    return zero, ret
