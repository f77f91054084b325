"""Making the batches an RL run trains on (docs/architecture.md): prompts -> rollout ->
``on_rollout_end`` -> scoring (rewards, shaping, the sample filter's verdict; more prompts while
the filter keeps too few groups) -> the failure policy (failed samples retried, their groups
dropped or masked: `rlhf.runtime.rl.failures`) -> ``on_rewards`` -> tensors.

The trainer sees `Batches`: ``next(step)`` gives each step's `Prepared` batch, and the run's
lifecycle passes through it (start, the weights after an update, checkpoints, eval, the end).
`SyncBatches` makes each batch when the step asks for it; ``--async``'s maker
(`rlhf.runtime.rl.async_generation.AsyncGeneration`) makes them ahead, on threads of its own. Both
make a batch with the same `BatchSteps`, whole or, pipelined, in stages (`BatchSteps.roll_out`,
`end_rollout`, `call_rewards`, `finish`) that give the same batch bit for bit.

Neither knows about data-parallel ranks: the runtime hands them roles that share the prompts
out and agree on the scores (rlhf/runtime/rl/ranks.py), and events that only the main rank fires.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlhf.core.batch import ExperienceBatch, collate
from rlhf.core.errors import RlhfError
from rlhf.core.outcomes import TRAINED
from rlhf.core.protocols.roles import RolloutRole
from rlhf.core.protocols.rollout import SamplingParams
from rlhf.core.rewards import RewardResult
from rlhf.core.types import Trajectory, groups_of, number_groups
from rlhf.runtime.config.train_plan import RunPlan
from rlhf.runtime.rl.events import Events
from rlhf.runtime.rl.failures import (MASK, RETRY, Retries, failed, first_error, group_failed, outcome_metrics,
                                      policy_of, retry_seed)
from rlhf.runtime.rl.scoring import Scored, Scoring
from rlhf.runtime.rl.step_metrics import Timer, merge_round_metrics
from rlhf.runtime.run.data import PromptLoader


@dataclass(kw_only=True)
class Prepared:
    """One step's batch, ready for experience making."""

    step: int  # the step that trains on it
    version: int  # the policy version that generated it
    trajectories: list[Trajectory]
    batch: ExperienceBatch
    reward_metrics: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)  # time per phase of its making
    idle_s: float = 0.0  # time the producer waited for the weights of `version` (--async)
    metrics: dict[str, float] = field(default_factory=dict)  # of its making, for the step's (--async: staleness)
    outcome_metrics: dict[str, float] = field(default_factory=dict)  # outcome/*: how its trajectories ended


@dataclass(kw_only=True)
class Rolled:
    """A step's trajectories, generated and not yet scored (the pipeline's first stage)."""

    step: int
    trajectories: list[Trajectory]
    batch: ExperienceBatch | None = None  # their tensors, for the behaviour log-probs (rewards still zero)
    seconds: dict[str, float] = field(default_factory=dict)
    items: list[Any] = field(default_factory=list)  # the prompts sampled (a retry samples one again)


class Batches(Protocol):
    """What the trainer asks of batch making."""

    def start(self, start_step: int) -> None:
        """The run starts (or resumes) at ``start_step``."""

    def next(self, step: int) -> Prepared:
        """The batch step ``step`` trains on."""

    def sync_weights(self) -> None:
        """The policy was updated: batches sample from its new weights from now on."""

    def quiesce(self, done: int) -> None:
        """A checkpoint after ``done`` steps is about to be written."""

    def publish(self, done: int) -> None:
        """Step ``done`` is finished, its checkpoint written."""

    def can_checkpoint(self, done: int) -> bool:
        """Whether a checkpoint after ``done`` steps, one not scheduled (a stop), can be written exactly."""

    def eval_stream(self, state: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
        """Around an eval: where its sampling draws its random numbers (``state["rng"]``, kept)."""

    def checkpoint_roles(self) -> dict[str, Any]:
        """What a checkpoint saves of batch making: name -> an object with ``save(dir)``/``load(dir)``."""

    def close(self) -> None:
        """The run ends, however it ends."""


class BatchSteps:
    """The steps of making a batch, the same for every maker. ``rollout``: the role that samples
    (the trainer's, or ``--async``'s policy copy's). The pipelined stages call the two halves of
    ``scoring`` (`Scoring.call_rewards`, `Scoring.judge`), so they need it unwrapped: ``--async``
    runs in one process."""

    def __init__(self, plan: RunPlan, *, scoring: Scoring, loader: PromptLoader, pad_token_id: int,
                 events: Events, prompt_multiple: int = 1):
        config = plan.config
        self.scoring, self.loader, self.pad_token_id, self.events = scoring, loader, pad_token_id, events
        self.n_samples, self.wanted = config.n_samples, config.prompts_per_step
        self.filters_groups = plan.filters_groups
        self.max_rounds = config.max_filter_rounds if plan.filters_groups else 1
        self.prompt_multiple = prompt_multiple  # a generate call's prompts come in multiples of this
        self.policy = policy_of(config)  # --on-failure
        self.masks = self.policy == MASK  # failed samples stay, masked; else their groups leave the batch
        self.max_retries = config.max_retries if self.policy == RETRY else 0
        self.retries = Retries(seed=config.seed, max_retries=self.max_retries, prompt_multiple=prompt_multiple)
        self.sampling = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                       top_p=config.top_p, top_k=config.top_k,
                                       repetition_penalty=config.repetition_penalty,
                                       return_logprobs=plan.rollout_logprobs,  # the policy loss reads them
                                       # tokens.jsonl's, where free (the update then does not see them)
                                       logprobs_if_free=config.log_tokens > 0)

    def prepare(self, step: int, rollout: RolloutRole, version: int | None = None) -> Prepared:
        """The batch of a step, whole: prompt groups sampled (by the policy's ``version``, default
        ``step``), scored, shaped and filtered (`_collect`), the ``on_rewards`` event, then tensors."""
        timer = Timer()
        trajectories, reward_metrics, outcomes = self._collect(step, rollout, timer, step if version is None else version)
        return self._collated(step, trajectories, reward_metrics, timer, outcomes)

    def _collect(self, step: int, rollout: RolloutRole, timer: Timer, version: int
                 ) -> tuple[list[Trajectory], dict[str, float], dict[str, float]]:
        """Sample and score ``--prompts-per-step`` prompt groups; with a sample filter, drop the
        groups it rejects and sample new prompts until enough are kept (``--max-filter-rounds``)."""
        kept: list[list[Trajectory]] = []
        rounds = dropped = sampled = retries = 0
        metrics: list[tuple[dict[str, float], int]] = []
        last: list[list[Trajectory]] = []
        seen: list[Trajectory] = []  # every round's trajectories, after retries
        while len(kept) < self.wanted and rounds < self.max_rounds:
            rounds += 1
            need = self.wanted - len(kept)
            need += -need % self.prompt_multiple
            with timer("rollout"):
                items = self.loader.next_batch(need)
                trajectories = rollout.generate(items, n=self.n_samples, params=self._sampling(version))
            with timer("reward"):
                self.events.emit("on_rollout_end", step=step, trajectories=trajectories)
                scored = self.scoring.score(trajectories)
            scored, again = self._retried(step, rounds, items, scored, rollout, timer, version)
            retries += again
            seen += scored.trajectories
            groups = groups_of(scored.trajectories, self.n_samples)
            sampled += len(groups)
            dropped += scored.keep.count(False)
            metrics.append((scored.metrics, len(scored.trajectories)))
            trained = [self.masks or not group_failed(g) for g in groups]
            kept += [g for g, k, t in zip(groups, scored.keep, trained) if k and t]
            last = [g for g, t in zip(groups, trained) if t]
        return self._kept(step, kept, last, rounds=rounds, sampled=sampled, dropped=dropped, metrics=metrics,
                          seen=seen, retries=retries)

    def _retried(self, step: int, round_: int, items: list[Any], scored: Scored, rollout: RolloutRole,
                 timer: Timer, version: int,
                 draws: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
                 ) -> tuple[Scored, int]:
        """``--on-failure retry``: the failed samples generated again (`Retries.again`, each with its
        own seed, inside ``draws()``) and the batch scored again, until none fails or
        ``--max-retries`` attempts were made; and how many samples were generated again."""
        count = 0
        for attempt in range(1, self.max_retries + 1):
            bad = failed(scored.trajectories)
            if not bad:
                break
            trajectories = list(scored.trajectories)
            with timer("rollout"):
                for index in bad:
                    with draws():
                        again = self.retries.again(rollout, items[index // self.n_samples], self._sampling(version),
                                                   seed=retry_seed(self.retries.seed, step, round_, index, attempt))
                    again.group = trajectories[index].group
                    trajectories[index] = again
            count += len(bad)
            with timer("reward"):
                self.events.emit("on_rollout_end", step=step, trajectories=[trajectories[i] for i in bad])
                scored = self.scoring.score(trajectories)
        return scored, count

    def _sampling(self, version: int) -> SamplingParams:
        """The run's sampling settings, stamped with the policy ``version`` that samples."""
        return dataclasses.replace(self.sampling, policy_version=version)

    def _kept(self, step: int, kept: list[list[Trajectory]], last: list[list[Trajectory]], *, rounds: int,
              sampled: int, dropped: int, metrics: list[tuple[dict[str, float], int]], seen: list[Trajectory],
              retries: int = 0) -> tuple[list[Trajectory], dict[str, float], dict[str, float]]:
        """The groups a step trains on, renumbered, the rounds' reward (and filter) metrics and the
        outcome metrics (`outcome_metrics`).
        ``last``: the last round's groups that may train (no failure, or ``mask``); ``seen``: every
        trajectory sampled for the step (after retries), for the outcome metrics."""
        failed_groups = 0 if self.masks else sum(group_failed(g) for g in groups_of(seen, self.n_samples))
        if self.filters_groups:
            if not kept:
                self.events.warn("step %d: no prompt group passed the sample filter in %d rounds; training on the "
                                 "last round's groups unfiltered", step + 1, rounds)
                kept = last
            elif len(kept) < self.wanted:
                self.events.warn("step %d: %d of %d prompt groups passed the sample filter in %d rounds (--max-"
                                 "filter-rounds); training on those", step + 1, len(kept), self.wanted, rounds)
        if not kept:
            raise RlhfError(f"step {step + 1}: every prompt group failed (--on-failure {self.policy}); the first "
                            f"failure: {first_error(seen)}")
        kept = kept[:self.wanted]
        merged = merge_round_metrics(metrics)
        if self.filters_groups:
            merged.update({"filter/rounds": float(rounds), "filter/dropped_groups": float(dropped),
                           "filter/kept_groups": float(len(kept)), "filter/sampled_groups": float(sampled),
                           "filter/pass_rate": (sampled - dropped) / max(sampled, 1)})
        return number_groups(kept), merged, outcome_metrics(seen, retries=retries, dropped_groups=failed_groups)

    def _collated(self, step: int, trajectories: list[Trajectory], reward_metrics: dict[str, float],
                  timer: Timer, outcomes: dict[str, float]) -> Prepared:
        """The scored batch of a step as tensors, after the ``on_rewards`` event."""
        with timer("experience"):
            # a failed sample (mask) and one without a reward leave the loss and the baselines
            counts = [t.reward is not None and t.outcome in TRAINED for t in trajectories]
            rewards = torch.tensor([t.reward if c else 0.0 for t, c in zip(trajectories, counts)],
                                   dtype=torch.float32)  # (B,)
            sample_mask = torch.tensor(counts, dtype=torch.float32)  # (B,)
            self.events.emit("on_rewards", step=step, trajectories=trajectories, rewards=rewards)
            batch = collate(trajectories, pad_token_id=self.pad_token_id, rewards=rewards * sample_mask,
                            sample_mask=sample_mask)
        return Prepared(step=step, version=step, trajectories=trajectories, batch=batch, reward_metrics=reward_metrics,
                        seconds=dict(timer.seconds), outcome_metrics=outcomes)

    # The same batch in stages that run on three threads (--async without a sample filter, where
    # no batch's rewards decide whether to sample more): together they give what `prepare` gives.

    def roll_out(self, step: int, rollout: RolloutRole, version: int | None = None) -> Rolled:
        """Stage 1 (a generation thread; its random draws in step order): sample the step's prompt
        groups, by the policy's ``version`` (default: ``step``)."""
        timer = Timer()
        with timer("rollout"):
            items = self.loader.next_batch(self.wanted)
            trajectories = rollout.generate(items, n=self.n_samples,
                                            params=self._sampling(step if version is None else version))
        return Rolled(step=step, trajectories=trajectories, seconds=dict(timer.seconds), items=items)

    def end_rollout(self, rolled: Rolled) -> Rolled:
        """Stage 1, end (in step order): ``on_rollout_end``, then tensors for the behaviour log-probs
        (the rewards come in stage 3)."""
        self.events.emit("on_rollout_end", step=rolled.step, trajectories=rolled.trajectories)
        size = len(rolled.trajectories)
        rolled.batch = collate(rolled.trajectories, pad_token_id=self.pad_token_id, rewards=torch.zeros(size),
                               sample_mask=torch.ones(size))
        return rolled

    def call_rewards(self, rolled: Rolled) -> RewardResult:
        """Stage 2 (a thread per batch, several batches at once): the reward sources' call."""
        began = time.perf_counter()
        result = self.scoring.call_rewards(rolled.trajectories)
        rolled.seconds["reward"] = time.perf_counter() - began
        return result

    def finish(self, rolled: Rolled, result: RewardResult, retry: RolloutRole | None = None,
               version: int | None = None,
               draws: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> Prepared:
        """Stage 3 (the finishing thread, in step order): shaping, ``on_rewards``, tensors. With
        ``retry`` (a rollout role holding the batch's policy ``version``) the failed samples are
        generated again under ``--on-failure retry`` as `prepare` does (`_retried`), each inside
        ``draws()`` (what keeps the other threads off the process's random stream meanwhile);
        without, their groups leave the batch."""
        timer = Timer()
        timer.seconds.update(rolled.seconds)
        with timer("reward"):
            scored: Scored = self.scoring.judge(rolled.trajectories, result)
        retries = 0
        if retry is not None:
            scored, retries = self._retried(rolled.step, 1, rolled.items, scored, retry, timer,
                                            rolled.step if version is None else version, draws)
        groups = groups_of(scored.trajectories, self.n_samples)
        trained = [self.masks or not group_failed(g) for g in groups]
        trajectories, merged, outcomes = self._kept(rolled.step, [g for g, t in zip(groups, trained) if t],
                                          [g for g, t in zip(groups, trained) if t], rounds=1, sampled=len(groups),
                                          dropped=scored.keep.count(False),
                                          metrics=[(scored.metrics, len(scored.trajectories))],
                                          seen=scored.trajectories, retries=retries)
        return self._collated(rolled.step, trajectories, merged, timer, outcomes)


class SyncBatches:
    """Each step's batch made when the step asks for it, with the trainer's own rollout."""

    def __init__(self, steps: BatchSteps, rollout: RolloutRole):
        self.steps, self.rollout = steps, rollout

    def start(self, start_step: int) -> None:
        pass

    def next(self, step: int) -> Prepared:
        return self.steps.prepare(step, self.rollout)

    def sync_weights(self) -> None:
        self.rollout.sync_weights()  # in-process engines share the weights; others get them pushed

    def quiesce(self, done: int) -> None:
        pass

    def publish(self, done: int) -> None:
        pass

    def can_checkpoint(self, done: int) -> bool:
        return True

    @contextlib.contextmanager
    def eval_stream(self, state: dict[str, Any]) -> Iterator[None]:
        yield  # eval draws from the process's random stream, at the same points on a resumed run

    def checkpoint_roles(self) -> dict[str, Any]:
        """The rollout, when it keeps state of its own."""
        return {"rollout": self.rollout} if self.rollout.stateful else {}

    def close(self) -> None:
        pass
