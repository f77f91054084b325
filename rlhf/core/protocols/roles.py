"""The roles a training run drives, as the trainer loop sees them (docs/architecture.md).

The local runtime implements each with a plain worker class in this process
(``rlhf/runtime/rl/workers.py``, ``rlhf/runtime/rl/rollout.py``); the Ray runtime with a handle that fans
the call out to the actors holding the role (``rlhf/runtime/ray/groups.py``). The loop
(``rlhf/runtime/rl/trainer.py``) is written against these protocols only, and a test checks that
both runtimes' classes implement them.

Batches are ``rlhf.core.batch.ExperienceBatch`` (every data-parallel rank receives the whole
batch and works on its share); results come back whole, gathered over ranks.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from rlhf.core.batch import ExperienceBatch
    from rlhf.core.rewards import RewardResult
    from rlhf.core.protocols.rollout import SamplingParams
    from rlhf.core.types import Trajectory


@runtime_checkable
class TrainedRole(Protocol):
    """A role with weights that train: checkpointed, and watched for non-finite steps."""

    nonfinite_in_a_row: int  # optimizer steps skipped in a row for a NaN/inf loss or gradient

    def fit(self, batch: ExperienceBatch, *, step: int) -> dict[str, float]:
        """Every optimizer step of one rollout batch; metrics namespaced (``policy/loss``, ...)."""

    def save(self, directory: Path) -> None:
        """Write this role's state (weights, optimizer) into ``directory`` (called on every rank)."""

    def load(self, directory: Path) -> None: ...


@runtime_checkable
class PolicyRole(TrainedRole, Protocol):
    def fit(self, batch: ExperienceBatch, *, step: int, kl_coef: float | None = None) -> dict[str, float]:
        """As `TrainedRole.fit`; ``kl_coef`` is this step's β of the KL term when it adapts."""

    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """(B, A) log-probs of the batch's tokens at the sampling temperature (the old log-probs)."""


@runtime_checkable
class CriticRole(TrainedRole, Protocol):
    def values(self, batch: ExperienceBatch) -> torch.Tensor:
        """(B, A): position t holds the value of the state that ends at token t, 0 off the action mask."""


@runtime_checkable
class ReferenceRole(Protocol):
    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """(B, A) log-probs under the frozen reference model."""


@runtime_checkable
class RolloutRole(Protocol):
    stateful: bool  # holds state of its own (its sampling RNG) that checkpoints must save

    def generate(self, prompts: list[Any], *, n: int, params: SamplingParams) -> list[Trajectory]:
        """``n`` trajectories per prompt item, contiguous, in prompt order, groups numbered in the batch."""

    def sync_weights(self) -> None:
        """The policy changed: sample from its new weights from now on."""

    def save(self, directory: Path) -> None:
        """``stateful`` only: write the role's own state."""

    def load(self, directory: Path) -> None: ...


@runtime_checkable
class RewardRole(Protocol):
    def score(self, trajectories: list[Trajectory]) -> RewardResult:
        """Every trajectory's total reward (reward sources plus environment rewards; None: dropped from
        the loss), each source's scores (``env`` among them when an environment gave rewards), metrics."""
