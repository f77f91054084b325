"""The training loop (DESIGN §5), the same for every runtime.

One step: G prompts -> n trajectories each -> rewards -> experience (old/reference log-probs,
values, KL) -> advantages -> policy (and critic) updates -> weight sync -> log -> checkpoint.

The loop talks to the roles of `Workers` through the protocols of ``rlhf.core.roles``: the local
runtime fills it with in-process workers, the Ray runtime with handles on actor groups. Under a
launcher every rank runs this loop: prompts are split over the ranks for generation, rewards are
scored and lifecycle events fired on the main rank, and every rank trains on its slice of each
minibatch (``rlhf/core/distributed.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.core.batch import collate
from rlhf.core.distributed import SINGLE, DistContext, unshard
from rlhf.core.errors import RlhfError
from rlhf.core.fingerprint import fingerprint_differences, plugin_fingerprint
from rlhf.core.plugins import PluginSet
from rlhf.core.roles import CriticRole, PolicyRole, ReferenceRole, RewardRole, RolloutRole
from rlhf.core.rollout import SamplingParams
from rlhf.core.types import RunInfo, Trajectory
from rlhf.runtime.data import PromptLoader
from rlhf.runtime.experience import ExperienceMaker
from rlhf.runtime.plan import RunPlan
from rlhf.runtime.lifecycle import run_loop
from rlhf.runtime.run_dir import RunDirectory
from rlhf.runtime.step_metrics import step_metrics

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Workers:
    """Everything the loop drives. ``reference`` and ``critic`` are None when the run needs none."""

    policy: PolicyRole
    rollout: RolloutRole
    reward: RewardRole
    reference: ReferenceRole | None = None
    critic: CriticRole | None = None
    loader: PromptLoader
    pad_token_id: int
    export: Callable[[Path], None]  # writes the final policy (and --save-critic's critic); called on every rank
    dist: DistContext = SINGLE  # data-parallel ranks when started by a launcher (every rank runs this loop)


class Timer:
    """Seconds per phase of a step, and the whole step."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        began = time.perf_counter()
        yield
        self.seconds[phase] = time.perf_counter() - began

    def done(self) -> dict[str, float]:
        return {**self.seconds, "step": time.perf_counter() - self.started}


class Trainer:
    def __init__(self, plan: RunPlan, plugins: PluginSet, workers: Workers):
        self.plan, self.config, self.plugins, self.w = plan, plan.config, plugins, workers
        self.dist = workers.dist
        self.run_dir = RunDirectory(plan.derived.out_dir, self.dist)
        self.total_steps = plan.total_steps(len(workers.loader))
        self.sampling = SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=self.config.temperature,
                                       top_p=self.config.top_p, return_logprobs=plan.rollout_logprobs)
        self.experience = ExperienceMaker(
            plan.algorithm, plan.advantage_config, n_samples=self.config.n_samples, plugins=plugins,
            recompute_old=plan.algorithm.needs_old_logprobs(plan.derived.optimizer_steps_per_step))
        self.fingerprint = plugin_fingerprint(plugins)
        self.start_step = 0
        self.failed_reward_steps = 0  # steps in a row where a reward source failed on every sample

    # --- the run --------------------------------------------------------------------------------

    def run(self) -> Path:
        """The run's lifecycle (``rlhf.runtime.lifecycle``): resume, steps, checkpoints, ``final/``."""
        config = self.plan.run_config()
        plugins = {"fingerprint": self.fingerprint, "plugins": [r.to_json() for r in self.plugins.records if r.loaded]}
        return run_loop(self, config=config, plugins_record=plugins, resume=self.config.resume,
                        save_every=self.config.save_every, keep_checkpoints=self.config.keep_checkpoints,
                        progress=self.config.progress, command="train")

    def run_step(self, step: int, run: RunInfo) -> dict[str, float]:
        metrics = self.step(step, run)
        self._check_rewards(step, metrics)
        return metrics

    def export_final(self, directory: Path) -> None:
        self.run_dir.write_final(self.w.export, directory)

    def step(self, step: int, run: RunInfo) -> dict[str, float]:
        w, timer = self.w, Timer()
        with timer("rollout"):
            prompts = w.loader.next_batch(self.config.prompts_per_step)  # the same on every rank
            local = w.rollout.generate(self.dist.shard(prompts), n=self.config.n_samples, params=self.sampling)
            trajectories = self._gather(local, len(prompts))
        with timer("reward"):
            trajectories, rewards, sample_mask, reward_metrics = self._score(step, run, trajectories)
        with timer("experience"):
            batch = collate(trajectories, pad_token_id=w.pad_token_id, rewards=rewards * sample_mask,
                            sample_mask=sample_mask)
            batch = self.experience.make(batch, w.policy, w.reference, w.critic)
        with timer("train"):
            train = w.policy.fit(batch, step=step)
            if w.critic is not None:
                train.update(w.critic.fit(batch, step=step))
            self._check_finite()
        with timer("sync"):
            w.rollout.sync_weights()  # in-process engines share the weights; others get them pushed
        return step_metrics(trajectories, batch, reward_metrics, train, timer.done())

    # --- the pieces of a step -------------------------------------------------------------------

    def _gather(self, local: list[Trajectory], num_prompts: int) -> list[Trajectory]:
        """Every rank's trajectories in prompt order, with groups renumbered to the whole batch."""
        if not self.dist.active:
            return local
        n = self.config.n_samples
        per_rank = [[shard[i:i + n] for i in range(0, len(shard), n)] for shard in self.dist.all_gather(local)]
        groups = unshard(per_rank)  # prompt p came from rank p % W
        assert len(groups) == num_prompts, f"gathered {len(groups)} prompt groups, expected {num_prompts}"
        trajectories = []
        for index, group in enumerate(groups):
            for trajectory in group:
                trajectory.group = index
                trajectories.append(trajectory)
        return trajectories

    def _score(self, step: int, run: RunInfo, trajectories: list[Trajectory]) -> tuple[Any, ...]:
        """Rewards on the main rank, between the rollout and reward events; every rank gets the
        result after the events' edits: trajectories, rewards (B,), sample mask (B,), metrics."""
        if self.dist.is_main:
            self._emit("on_rollout_end", run=run, step=step, trajectories=trajectories)
            result = self.w.reward.score(trajectories)
            result.assign(trajectories)
            rewards = torch.tensor([r if r is not None else 0.0 for r in result.total], dtype=torch.float32)  # (B,)
            sample_mask = torch.tensor([r is not None for r in result.total], dtype=torch.float32)  # (B,)
            self._emit("on_rewards", run=run, step=step, trajectories=trajectories, rewards=rewards)
            scored = (trajectories, rewards, sample_mask, result.metrics)
        else:
            scored = None
        return self.dist.broadcast(scored) if self.dist.active else scored

    def _check_rewards(self, step: int, metrics: dict[str, float]) -> None:
        """A reward source that failed on every sample teaches nothing: say so, and stop after
        ``--max-failed-reward-steps`` such steps in a row."""
        size = self.plan.derived.rollout_batch_size
        failed = sorted(k.removeprefix("reward/failures/") for k, v in metrics.items()
                        if k.startswith("reward/failures/") and v >= size)
        self.failed_reward_steps = self.failed_reward_steps + 1 if failed else 0
        if not failed:
            return
        limit = self.config.max_failed_reward_steps
        if self.failed_reward_steps >= limit:
            raise RlhfError(f"the reward {', '.join(failed)} failed on every sample for {self.failed_reward_steps} "
                            f"steps in a row (--reward-on-error {self.config.reward_options.on_error}); fix the reward "
                            "(run with --reward-on-error raise to see its error) or raise --max-failed-reward-steps")
        if self.dist.is_main:
            log.warning("step %d: the reward %s failed on every sample (--reward-on-error %s); the run stops after %d "
                        "such steps in a row", step + 1, ", ".join(failed), self.config.reward_options.on_error, limit)

    def _check_finite(self) -> None:
        for name in ("policy", "critic"):
            role = getattr(self.w, name)
            if role is not None and role.nonfinite_in_a_row >= self.config.max_nonfinite_steps:
                raise RlhfError(
                    f"the {name} loss or gradient was NaN/inf for {role.nonfinite_in_a_row} optimizer steps in a "
                    "row (each was skipped); lower --lr, check the rewards, or raise --max-nonfinite-steps")

    def _emit(self, event: str, **kwargs: Any) -> None:
        if self.dist.is_main:
            self.plugins.emit(event, **kwargs)

    # --- checkpoints ----------------------------------------------------------------------------

    def checkpoint_roles(self) -> dict[str, Any]:
        """What a checkpoint holds: the trained roles, and the rollout when it keeps state of its own."""
        roles = {name: getattr(self.w, name) for name in ("policy", "critic") if getattr(self.w, name) is not None}
        if self.w.rollout.stateful:
            roles["rollout"] = self.w.rollout
        return roles

    def trainer_state(self) -> dict[str, Any]:
        return {"loader": self.w.loader.state_dict(), "fingerprint": self.fingerprint,
                "world_size": self.dist.world_size}

    def restore(self, state: dict[str, Any]) -> None:
        self.w.loader.load_state_dict(state["loader"])
        differences = fingerprint_differences(state["fingerprint"], self.fingerprint)
        if differences and self.dist.is_main:
            log.warning("resuming with a different plugin set than the checkpoint was written with:\n  %s",
                        "\n  ".join(differences))
