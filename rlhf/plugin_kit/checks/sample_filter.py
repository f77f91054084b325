"""Contract of a sample filter (``register_sample_filters``): called with the step's prompt groups
(lists of scored trajectories) it returns one keep flag per group; the verdict of a group depends on
its contents, not on where it sits (reversing the groups reverses the flags); it does not change the
trajectories; it is deterministic; an empty step gives an empty list."""

from __future__ import annotations

import copy
from typing import Any

from rlhf.plugin_kit.checks.target import Target

# (reward, score) per sample of four groups of three: constant, varied, one dropped sample, all equal zero
GROUPS = [[(1.0, 1.0)] * 3, [(0.0, 0.0), (1.0, 1.0), (0.5, 0.5)], [(None, None), (1.0, 1.0), (0.0, 0.0)],
          [(0.0, 0.0)] * 3]


def _groups() -> list[list[Any]]:
    from rlhf.core.types import Trajectory

    groups = []
    for index, samples in enumerate(GROUPS):
        groups.append([Trajectory(token_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], prompt_length=2,
                                  prompt=f"prompt {index}", prompt_text=f"prompt {index}", completion_text="ab",
                                  group=index, label=str(index), columns={"answer": str(index)}, reward=reward,
                                  rewards={"check": reward}, score=score, finish_reason="stop")
                       for reward, score in samples])
    return groups


def check(target: Target) -> list[str]:
    config = target.config()

    def run(groups: list[list[Any]], what: str) -> list[bool]:
        try:
            keep = target.obj(groups, config)
        except Exception as exc:
            raise target.fail(f"raised {type(exc).__name__}: {exc} ({what})") from exc
        try:
            keep = list(keep)
        except TypeError:
            raise target.fail(f"must return one keep flag per group (a list of bools), got {type(keep).__name__}")
        if len(keep) != len(groups):
            raise target.fail(f"returned {len(keep)} flags for {len(groups)} prompt groups ({what})")
        if not all(isinstance(k, bool) or type(k).__name__ == "bool_" for k in keep):
            raise target.fail(f"the flags must be bools, got {[type(k).__name__ for k in keep]} ({what})")
        return [bool(k) for k in keep]

    groups = _groups()
    before = copy.deepcopy(groups)
    keep = run(groups, "four groups of three")
    lines = [f"one bool per prompt group (kept {sum(keep)} of {len(keep)} synthetic groups)"]
    if [[(t.reward, t.score, t.token_ids) for t in g] for g in groups] != \
            [[(t.reward, t.score, t.token_ids) for t in g] for g in before]:
        raise target.fail("changed the trajectories it was given; a filter only decides which groups stay")
    lines.append("leaves the trajectories unchanged")
    if run(_groups(), "the same groups again") != keep:
        raise target.fail("gave other flags for the same groups: a filter must be deterministic")
    lines.append("deterministic")
    if run(list(reversed(_groups())), "the groups in reverse order") != list(reversed(keep)):
        raise target.fail("the verdict of a group changed with its position in the step; decide each group "
                          "from its contents")
    lines.append("a group's verdict does not depend on its position")
    if run([], "a step without groups") != []:
        raise target.fail("should return [] for a step without groups")
    lines.append("an empty step gives []")
    return lines
