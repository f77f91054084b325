"""The failure policy of an RL run, ``--on-failure retry|drop-group|mask`` (docs/outcomes.md).

A trajectory whose outcome is a failure (`rlhf.core.outcomes`: ``env_error``, ``reward_error``,
``tool_timeout``, ...) never trains, and its reward never enters the loss or its group's baseline
as a number. What happens to it:

- ``retry`` (default): the sample is generated again, with a fresh environment and a seed of its
  own, `retry_seed` of the run's seed, the step, the sampling round, the sample's index in the
  batch and the attempt (its random numbers come from a stream of their own, so the process's
  stream, and with it every later sample, is the same as without the retry), and the batch is
  scored again; at most ``--max-retries`` times, then as ``drop-group``.
- ``drop-group``: the failed sample's whole prompt group leaves the batch, which then has fewer
  groups (as when a sample filter drops groups: with ``--filter-groups`` new prompts are sampled
  to make up for them). A step where every group failed stops the run with the first failure.
- ``mask``: the group stays; the failed samples get sample mask 0, so loss mask 0 and advantage 0,
  and the estimator takes its baseline over the group's other samples (an estimator registered
  with ``supports_masking``; the plan refuses another).

``--reward-on-error skip`` is ``--reward-on-error fail`` with the policy ``mask`` (`policy_of`).
Under ``--async`` the finishing thread retries, on a policy copy of its own holding the batch's
version, while no generation lane draws from the process's random stream
(`rlhf.runtime.rl.async_generation`): the same seeds, the same samples, whatever the timing.

Where the sampling happens: a rollout role that samples in this process gets the seeded stream
here (`seeded_stream` around its ``generate``); one that samples elsewhere (the Ray runtime's
rollout actors) says so with a ``generate_seeded(prompts, *, n, params, seed)`` of its own, which
seeds the stream where it samples, the same way (`generate_seeded`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

from rlhf.core.outcomes import FAILURES, OUTCOMES, REWARD_ERROR, TRAINED, fail_trajectory
from rlhf.core.rewards import RewardResult
from rlhf.core.types import Trajectory

RETRY, DROP_GROUP, MASK = "retry", "drop-group", "mask"
POLICIES = (RETRY, DROP_GROUP, MASK)


def policy_of(config: Any) -> str:
    """The run's failure policy: ``--on-failure``, or ``mask`` under ``--reward-on-error skip``."""
    return MASK if config.reward_options.on_error == "skip" else config.on_failure


def retry_seed(seed: int, step: int, round_: int, index: int, attempt: int) -> int:
    """The seed of a sample's ``attempt``-th retry: a hash of the sample's identity (the run's seed,
    the step, the sampling round, its index in the batch) and the attempt number."""
    digest = hashlib.blake2b(f"retry/{seed}/{step}/{round_}/{index}/{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits


def mark_reward_failures(trajectories: Sequence[Trajectory], result: RewardResult, on_error: str) -> None:
    """Under ``--reward-on-error fail`` or ``skip``, a sample a reward source failed on ends with the
    outcome ``reward_error`` (unless it had failed before that)."""
    if on_error not in ("fail", "skip"):
        return
    for index, error in result.errors.items():
        if trajectories[index].outcome in TRAINED:
            fail_trajectory(trajectories[index], REWARD_ERROR, error)


def failed(trajectories: Sequence[Trajectory]) -> list[int]:
    """The indices of the trajectories whose outcome is a failure."""
    return [i for i, t in enumerate(trajectories) if t.outcome not in TRAINED]


def group_failed(group: Sequence[Trajectory]) -> bool:
    return any(t.outcome not in TRAINED for t in group)


def outcome_metrics(trajectories: Sequence[Trajectory], *, retries: int = 0, dropped_groups: int = 0
                    ) -> dict[str, float]:
    """``outcome/<outcome>_rate`` for every outcome, over ``trajectories``; ``outcome/retries`` (samples
    generated again) and ``outcome/dropped_groups`` (groups dropped for a failure)."""
    count = max(len(trajectories), 1)
    metrics = {f"outcome/{name}_rate": sum(t.outcome == name for t in trajectories) / count for name in OUTCOMES}
    unknown = {t.outcome for t in trajectories} - set(OUTCOMES)
    if unknown:
        raise ValueError(f"unknown trajectory outcome(s) {sorted(unknown)}; one of {', '.join(OUTCOMES)}")
    metrics["outcome/retries"] = float(retries)
    metrics["outcome/dropped_groups"] = float(dropped_groups)
    return metrics


def first_error(trajectories: Sequence[Trajectory]) -> str:
    for trajectory in trajectories:
        if trajectory.outcome in FAILURES:
            return f"{trajectory.outcome}: {trajectory.error}"
    return ""


@contextlib.contextmanager
def seeded_stream(seed: int) -> Iterator[None]:
    """This process's random stream (CPU and every GPU) seeded with ``seed`` inside, and put back as
    it was after."""
    import torch

    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def generate_seeded(rollout: Any, prompts: list[Any], *, n: int, params: Any, seed: int) -> list[Trajectory]:
    """``rollout.generate`` from a random stream seeded with ``seed``, the stream it samples from
    otherwise left as it was: the role's own ``generate_seeded`` where it has one (it samples in
    other processes), else `seeded_stream` here."""
    own = getattr(rollout, "generate_seeded", None)
    if own is not None:
        return own(prompts, n=n, params=params, seed=seed)
    with seeded_stream(seed):
        return rollout.generate(prompts, n=n, params=params)


class Retries:
    """Generates failed samples again (``--on-failure retry``), each with its own seed."""

    def __init__(self, *, seed: int, max_retries: int, prompt_multiple: int = 1):
        self.seed, self.max_retries, self.prompt_multiple = seed, max_retries, prompt_multiple

    def again(self, rollout: Any, item: Any, params: Any, *, seed: int) -> Trajectory:
        """One new sample of ``item`` (a fresh environment) from a random stream seeded with ``seed``;
        the stream the rollout samples from is left as it was (`generate_seeded`)."""
        # a generate call's prompts come in multiples of prompt_multiple (a launcher's ranks)
        return generate_seeded(rollout, [item] * self.prompt_multiple, n=1, params=params, seed=seed)[0]
