"""Segments: the extra rows of a trajectory that holds several sequences (an agent that edited or
summarised its history, docs/agents.md), added to a step's batch after its advantages.

A prompt group has n trajectories, and the advantage estimator sees exactly those n rows (its
baseline is over trajectories, not sequences). Then each extra sequence of trajectory i
(``Trajectory.segments``) becomes a row of its own, appended after the trajectories' rows, with

    reward_row = r_i,   sample_mask_row = sample_mask_i,   group_row = group_i,
    Â_row,t = Â_i,t0 · m_row,t   and   G_row,t = G_i,t0 · m_row,t

where t0 is the first action token of trajectory i's own row: the trajectory's sequence-level
advantage (for outcome estimators, grpo, dr_grpo, rloo, reinforce_pp_baseline with KL in the loss,
the value on every one of its tokens; with per-token advantages, a critic or KL in the reward, the
segment gets the first token's on all of its tokens). With ``--teacher`` (on-policy distillation)
the teacher's per-token term is the segment's own: the task's advantage as above (the trajectory's
first-token advantage less the teacher's term there) plus −λ · m_t · (old_t − tea_t) on each of the
segment's tokens, the teacher scoring the segment's tokens. Its old and reference log-probs, values and
KL are computed like the other rows', except its old (behaviour) log-probs under ``--async`` with
K > 0: the producer computes them with the policy copy that sampled the trajectory, beside its
batch's (`record_behaviour`, kept on the segment as ``behaviour_logprobs``), since the rows are made
after the weights moved on. ``trajectory_index`` says whose row each is, so minibatches
take a trajectory's rows together and count trajectories (`rlhf.runtime.step.micro_batches.minibatches`).

The loss aggregation counts a segment row like any row (`rlhf.core.types.LossNorm`): with
``token_mean`` each model token weighs the same, whichever sequence holds it; with the ``seq_mean_*``
aggregations each sequence is one of ``N_seq``, so a trajectory of k sequences weighs k.

Shape legend: ``B`` rows, ``A`` action positions.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch

from rlhf.algorithms.distillation import teacher_advantages
from rlhf.algorithms.training_loss import clamped_kl
from rlhf.core.batch import ExperienceBatch, collate
from rlhf.core.types import Trajectory


def with_segments(batch: ExperienceBatch, trajectories: list[Trajectory], *, pad_token_id: int, policy: Any,
                  reference: Any = None, critic: Any = None, kl_estimator: Any = None, teacher: Any = None,
                  teacher_coef: float = 1.0) -> ExperienceBatch:
    """``batch`` (a row per trajectory, advantages made) with a row appended for every segment of
    every trajectory; unchanged when no trajectory has segments. ``kl_estimator``: the run's, for
    the segments' KL when the batch has KL (clamped as the experience maker's); ``teacher`` and
    ``teacher_coef`` (λ): the run's ``--teacher``, when the batch has its log-probs."""
    owners = [row for row, trajectory in enumerate(trajectories) for _ in trajectory.segments]
    if not owners:
        return batch
    assert batch.size == len(trajectories), "segments are added once, to a row per trajectory"
    rows = torch.tensor(owners, dtype=torch.long)  # (E,)
    extra = collate([s for t in trajectories for s in t.segments], pad_token_id=pad_token_id,
                    rewards=batch.rewards[rows], sample_mask=batch.sample_mask[rows])
    if batch.rollout_logprobs is None:
        extra = replace(extra, rollout_logprobs=None)
    extra = replace(extra, group_index=batch.group_index[rows])
    segments = [s for t in trajectories for s in t.segments]
    old = None
    if batch.old_logprobs is not None:
        recorded = all(s.behaviour_logprobs is not None for s in segments)
        old = _per_position([s.behaviour_logprobs for s in segments], extra) if recorded else policy.logprobs(extra)
    ref = reference.logprobs(extra) if batch.ref_logprobs is not None else None  # (E, A')
    values = critic.values(extra) if batch.values is not None else None  # (E, A')
    tea = teacher.logprobs(extra) if batch.teacher_logprobs is not None else None  # (E, A')
    task = batch.advantages  # (B, A)
    if tea is not None:  # the trajectories' rows hold the task's advantage plus the teacher's own term per token
        task = task - teacher_advantages(batch.old_logprobs, batch.teacher_logprobs, batch.loss_mask,
                                         coef=teacher_coef).to(task.dtype)  # (B, A)
    advantages = _first_action(task, batch.action_mask)[rows, None] * extra.action_mask  # (E, A')
    if tea is not None:  # each segment token's own teacher term, its loss mask as everywhere
        advantages = advantages + teacher_advantages(old, tea, extra.loss_mask, coef=teacher_coef).to(advantages.dtype)
    extra = replace(extra, old_logprobs=old, ref_logprobs=ref, values=values, teacher_logprobs=tea,
                    kl=clamped_kl(kl_estimator, old, ref, mask=extra.action_mask) if batch.kl is not None else None,
                    advantages=advantages,
                    returns=_first_action(batch.returns, batch.action_mask)[rows, None] * extra.action_mask)
    index = torch.cat([torch.arange(batch.size), rows])  # (B + E,)
    return replace(concat(batch, extra, pad_token_id), trajectory_index=index)


def record_behaviour(trajectories: list[Trajectory], pad_token_id: int, logprobs: Any) -> None:
    """``--async`` with K > 0: each segment's behaviour log-probs, ``logprobs(batch)`` (E, A') under
    the policy copy that sampled its trajectory, kept per token on the segment (0.0 at token 0, as
    ``rollout_logprobs``)."""
    segments = [s for t in trajectories for s in t.segments]
    if not segments:
        return
    rows = collate(segments, pad_token_id=pad_token_id, rewards=torch.zeros(len(segments)),
                   sample_mask=torch.ones(len(segments)))
    values = logprobs(rows)  # (E, A')
    for row, segment in enumerate(segments):
        segment.behaviour_logprobs = [0.0] + values[row, : len(segment.token_ids) - 1].tolist()


def _per_position(per_token: list[list[float]], extra: ExperienceBatch) -> torch.Tensor:
    """Per-token lists (token t's at index t) as (E, A') tensors: position t holds token t + 1's."""
    out = torch.zeros(extra.action_mask.shape, dtype=torch.float32)  # (E, A')
    for row, values in enumerate(per_token):
        out[row, : len(values) - 1] = torch.tensor(values[1:], dtype=torch.float32)
    return out


def _first_action(values: torch.Tensor | None, action_mask: torch.Tensor) -> torch.Tensor:
    """Each row's value at its first action token, 0 for a row without one. (B, A) -> (B,)"""
    assert values is not None, "segments are added after the advantages and returns"
    first = action_mask.argmax(dim=1)  # (B,) the first 1 (0 when there is none)
    has = action_mask.sum(dim=1) > 0  # (B,)
    return torch.where(has, values.gather(1, first[:, None]).squeeze(1), torch.zeros_like(values[:, 0]))  # (B,)


def concat(first: ExperienceBatch, second: ExperienceBatch, pad_token_id: int) -> ExperienceBatch:
    """The rows of ``first`` then ``second``, right-padded to the longer one; a field either lacks is None."""
    merged: dict[str, Any] = {}
    for f in fields(ExperienceBatch):
        a, b = getattr(first, f.name), getattr(second, f.name)
        if a is None or b is None:
            merged[f.name] = None
            continue
        if a.dim() == 2 and a.shape[1] != b.shape[1]:
            width = max(a.shape[1], b.shape[1])
            fill = pad_token_id if f.name == "input_ids" else 0
            a, b = (torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill) for x in (a, b))
        merged[f.name] = torch.cat([a, b])
    return ExperienceBatch(**merged)
