"""Experience: a collated rollout batch completed with what the updates need (docs/architecture.md).

    old = policy log-probs          (only when several optimizer steps share the rollout, or KL is in the reward;
                                     --async with staleness > 0: the behaviour policy's, made with the batch)
    ref = reference log-probs       (when KL is used with β > 0)
    tea = teacher log-probs         (--teacher: on-policy distillation; old is then always computed)
    V   = critic values             (estimators with a critic)
    kl  = clamp(kl_est(old, ref))   masked to action tokens
    Â, G = estimator(rewards, masks, V, -β·kl in the reward when KL goes there, sample_mask)
    Â   += -λ·m·(old − tea)        (--teacher, λ = --teacher-coef: rlhf/algorithms/distillation.py)

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rlhf.algorithms.advantages import advantage_inputs, checked_advantages, default_config
from rlhf.algorithms.distillation import teacher_advantages
from rlhf.algorithms.training_loss import clamped_kl
from rlhf.core.batch import ExperienceBatch

if TYPE_CHECKING:
    import torch

    from rlhf.algorithms import ResolvedAlgorithm
    from rlhf.core.types import Trajectory


@dataclass(frozen=True)
class ExperienceMaker:
    algorithm: ResolvedAlgorithm
    advantage_config: Any  # the estimator's config object (None: its defaults)
    n_samples: int
    recompute_old: bool  # old log-probs need a forward of their own (ResolvedAlgorithm.needs_old_logprobs)
    teacher_coef: float = 1.0  # λ of the teacher's per-token advantages (when a teacher is given)

    def make(self, batch: ExperienceBatch, policy: Any, reference: Any = None, critic: Any = None, *,
             kl_coef: float | None = None, source_rewards: dict[str, Any] | None = None,
             metadata: list[dict[str, Any]] | None = None, teacher: Any = None) -> ExperienceBatch:
        """``kl_coef``: this step's β when adaptive (default: the algorithm's); ``source_rewards``
        and ``metadata`` are passed on to the advantage estimator. ``teacher``: a role with
        ``logprobs(batch)`` whose per-token reverse KL to the student's samples joins the advantages."""
        import torch

        algo = self.algorithm
        beta = algo.kl_coef if kl_coef is None else kl_coef
        old = batch.old_logprobs  # (B, A): given (--async: the behaviour policy's), else recomputed if needed
        if old is None and (self.recompute_old or teacher is not None):
            old = policy.logprobs(batch)  # (B, A)
        ref = reference.logprobs(batch) if reference is not None else None  # (B, A)
        tea = teacher.logprobs(batch) if teacher is not None else None  # (B, A)
        values = critic.values(batch) if critic is not None else None  # (B, A)
        kl = None
        if old is not None and ref is not None:
            kl = clamped_kl(algo.kl_estimator, old, ref, mask=batch.action_mask)  # (B, A)
        in_reward = algo.kl_in_reward
        inputs = advantage_inputs(
            algo.advantage, rewards=batch.rewards, action_mask=batch.action_mask, group_size=self.n_samples,
            values=values, kl=kl if in_reward else None, kl_coef=beta if in_reward else 0.0,
            sample_mask=batch.sample_mask.bool(), source_rewards=source_rewards, metadata=metadata)
        with torch.no_grad():
            config = self.advantage_config if self.advantage_config is not None else default_config(algo.advantage)
            estimate = algo.advantage.obj(inputs, config)  # the run's estimator, resolved once
        advantages, returns = checked_advantages(algo.advantage, estimate, tuple(batch.action_mask.shape))  # (B, A) x2
        if tea is not None:  # no baseline, no discount: each token gets its own term, on top of the task's
            advantages = advantages + teacher_advantages(old, tea, batch.loss_mask, coef=self.teacher_coef).to(
                advantages.dtype)  # (B, A)
        return replace(batch, old_logprobs=old, ref_logprobs=ref, teacher_logprobs=tea, values=values, kl=kl,
                       advantages=advantages, returns=returns)


def source_rewards(trajectories: list[Trajectory]) -> dict[str, torch.Tensor]:
    """Each reward source's rewards as (B,) float tensors (NaN where the source gave none), for
    ``AdvantageInputs.source_rewards``."""
    import torch

    names = sorted({name for t in trajectories for name in t.rewards})
    return {name: torch.tensor([t.rewards.get(name) if t.rewards.get(name) is not None else float("nan")
                                for t in trajectories], dtype=torch.float32) for name in names}


def row_metadata(trajectory: Trajectory) -> dict[str, Any]:
    """What an advantage estimator learns about a row (``AdvantageInputs.metadata``): its dataset
    columns (label included), the trajectory's info, finish reason, turns, policy tokens and score."""
    return {**trajectory.columns, "label": trajectory.label, "info": dict(trajectory.info),
            "finish_reason": trajectory.finish_reason, "num_turns": trajectory.num_turns,
            "num_policy_tokens": trajectory.num_policy_tokens, "score": trajectory.score}
