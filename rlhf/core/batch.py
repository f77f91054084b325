"""`ExperienceBatch`: trajectories as right-padded tensors (docs/architecture.md).

Shape legend: ``B`` sequences (the n samples of a prompt are contiguous rows), ``T`` tokens,
``A = T - 1`` action positions: position t holds what predicts token t+1, so
``action_mask[:, t] = loss_mask[t + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlhf.core.types import Trajectory


@dataclass(kw_only=True)
class ExperienceBatch:
    input_ids: torch.Tensor  # (B, T) right-padded
    attention_mask: torch.Tensor  # (B, T) 1 on real tokens
    action_mask: torch.Tensor  # (B, A) float, 1 where the policy generated token t+1
    rewards: torch.Tensor  # (B,) float32 combined rewards (0 where sample_mask is 0)
    sample_mask: torch.Tensor  # (B,) float, 0 drops a sample (failed under --on-failure mask, or unscored)
    group_index: torch.Tensor  # (B,) prompt index in the rollout batch
    rollout_logprobs: torch.Tensor | None = None  # (B, A) as the rollout engine reported them (0 off-action)
    old_logprobs: torch.Tensor | None = None  # (B, A)
    ref_logprobs: torch.Tensor | None = None  # (B, A)
    teacher_logprobs: torch.Tensor | None = None  # (B, A) the --teacher's, for on-policy distillation
    values: torch.Tensor | None = None  # (B, A)
    kl: torch.Tensor | None = None  # (B, A) KL estimate of the policy to the reference, masked
    advantages: torch.Tensor | None = None  # (B, A)
    returns: torch.Tensor | None = None  # (B, A)
    # (B,) long: the trajectory each row belongs to (its own row's index); rows past the trajectories'
    # are the segments of a branched agent trajectory (rlhf.runtime.step.segments). None: a row each.
    trajectory_index: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def loss_mask(self) -> torch.Tensor:
        """(B, A) action mask with dropped samples zeroed: what every loss averages over."""
        return self.action_mask * self.sample_mask[:, None]

    def select(self, rows: torch.Tensor | list[int]) -> ExperienceBatch:
        """The given rows, with trailing all-padding columns removed."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        picked = {f.name: (getattr(self, f.name)[rows] if getattr(self, f.name) is not None else None)
                  for f in fields(self)}
        batch = ExperienceBatch(**picked)
        length = int(batch.attention_mask.sum(dim=1).max())
        return batch.trim(length)

    def trim(self, length: int) -> ExperienceBatch:
        """Keep the first ``length`` tokens (and ``length - 1`` action positions)."""
        changes = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value.dim() < 2:
                continue
            changes[f.name] = value[:, :length] if f.name in ("input_ids", "attention_mask") else value[:, : length - 1]
        return replace(self, **changes)

    def to(self, device: torch.device | str) -> ExperienceBatch:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if getattr(self, f.name) is not None})


def collate(trajectories: list[Trajectory], *, pad_token_id: int, rewards: torch.Tensor,
            sample_mask: torch.Tensor) -> ExperienceBatch:
    """Right-pad trajectories into one batch. ``rewards`` and ``sample_mask`` are (B,)."""
    assert len(trajectories) == rewards.shape[0] == sample_mask.shape[0], "one reward per trajectory"
    length = max(len(t.token_ids) for t in trajectories)
    batch_size = len(trajectories)
    input_ids = torch.full((batch_size, length), pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((batch_size, length), dtype=torch.float32)  # (B, T)
    for row, trajectory in enumerate(trajectories):
        n = len(trajectory.token_ids)
        assert len(trajectory.loss_mask) == n, f"trajectory {row}: loss_mask and token_ids differ in length"
        input_ids[row, :n] = torch.tensor(trajectory.token_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(trajectory.loss_mask, dtype=torch.float32)
    rollout_logprobs = None
    if all(t.rollout_logprobs is not None for t in trajectories):
        rollout_logprobs = torch.zeros((batch_size, length - 1), dtype=torch.float32)  # (B, A)
        for row, trajectory in enumerate(trajectories):
            values = torch.tensor(trajectory.rollout_logprobs[1:], dtype=torch.float32)  # token t+1 at position t
            rollout_logprobs[row, : values.numel()] = values
    return ExperienceBatch(
        input_ids=input_ids,
        rollout_logprobs=rollout_logprobs,
        attention_mask=attention_mask,
        action_mask=loss_mask[:, 1:].contiguous(),  # (B, A): position t predicts token t+1
        rewards=rewards.float(),
        sample_mask=sample_mask.float(),
        group_index=torch.tensor([t.group for t in trajectories]),
    )
