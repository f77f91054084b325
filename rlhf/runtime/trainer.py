"""The training loop (DESIGN §5), the same for every runtime.

One step: G prompts -> n trajectories each -> rewards -> experience (old/reference log-probs,
values, KL) -> advantages -> policy (and critic) updates -> weight sync -> log -> checkpoint.
The loop talks to workers through `Workers`; the local runtime fills it with in-process
objects, the Ray runtime with actor handles exposing the same methods.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf.core.errors import RlhfError
from rlhf.core.plugins import PluginSet
from rlhf.core.rollout import SamplingParams
from rlhf.core.types import RunInfo
from rlhf.runtime import checkpoint
from rlhf.core.batch import ExperienceBatch, collate
from rlhf.runtime.config import Derived, TrainConfig
from rlhf.core.distributed import SINGLE, DistContext, unshard
from rlhf.runtime.progress import Progress

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RewardTotals:
    """Rewards of a batch when no reward source runs (the environment gives them)."""

    total: list[float | None]
    per_source: dict[str, list[float | None]]
    metrics: dict[str, float]


@dataclass(kw_only=True)
class Workers:
    """Everything the loop drives. ``reference`` and ``critic`` are None when not needed."""

    policy: Any
    rollout: Any
    reward: Any
    reference: Any = None
    critic: Any = None
    tokenizer: Any = None
    loader: Any = None
    algorithm: Any = None  # rlhf.algorithms.ResolvedAlgorithm
    advantage_config: Any = None
    pad_token_id: int = 0
    fingerprint: dict[str, Any] = field(default_factory=dict)
    export_policy: Any = None  # callable(out_dir): writes the final HF model
    rollout_logprobs: bool = False  # ask the engine for sampled tokens' log-probs (mismatch correction)
    dist: DistContext = SINGLE  # data-parallel ranks when started by a launcher (every rank runs this loop)


class Trainer:
    """Runs the loop. Under a launcher every rank runs it: prompts are split over the ranks for
    generation, rewards are scored and lifecycle events fired on the main rank, and every rank
    trains on its slice of each minibatch (rlhf/core/distributed.py)."""

    def __init__(self, config: TrainConfig, derived: Derived, plugins: PluginSet, workers: Workers):
        self.config, self.derived, self.plugins, self.w = config, derived, plugins, workers
        self.dist = workers.dist
        self.out = derived.out_dir
        self.total_steps = config.steps if config.steps is not None else max(1, len(workers.loader) //
                                                                             config.prompts_per_step)
        self.sampling = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                       top_p=config.top_p, return_logprobs=workers.rollout_logprobs)
        self.start_step = 0
        self.recompute_old = workers.algorithm.needs_old_logprobs(derived.optimizer_steps_per_step)

    # --- run --------------------------------------------------------------------------------

    def run(self) -> Path:
        if self.dist.is_main:
            self._prepare_out_dir()
        self.dist.barrier()
        if self.config.resume:
            self._resume()
        run = RunInfo(config=self.config.to_dict(), out_dir=self.out, start_step=self.start_step,
                      total_steps=self.total_steps, plugins=self.w.fingerprint.get("hash", ""))
        progress = Progress(self.total_steps, self.start_step, enabled=self.config.progress and self.dist.is_main)
        self._emit("on_run_start", run=run)
        status = "failed"
        try:
            for step in range(self.start_step, self.total_steps):
                metrics = self.step(step, run)
                self._emit("on_step_end", run=run, step=step, metrics=metrics)
                progress.update(step, metrics)
                done = step + 1
                if done == self.total_steps or (self.config.save_every and done % self.config.save_every == 0):
                    path = self._save_checkpoint(done)
                    self._emit("on_checkpoint", run=run, step=done, path=path)
            self.w.export_policy(self.out / "final")
            status = "completed"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            progress.close()
            self._emit("on_run_end", run=run, status=status)
        return self.out

    def _emit(self, event: str, **kwargs: Any) -> None:
        if self.dist.is_main:
            self.plugins.emit(event, **kwargs)

    def step(self, step: int, run: RunInfo) -> dict[str, float]:
        w, algo, timings = self.w, self.w.algorithm, {}
        started = time.perf_counter()

        prompts = w.loader.next_batch(self.config.prompts_per_step)  # the same on every rank
        trajectories = w.rollout.generate(self.dist.shard(prompts), n=self.config.n_samples, params=self.sampling)
        trajectories = self._gather_trajectories(trajectories, len(prompts))
        timings["rollout"] = time.perf_counter() - started

        mark = time.perf_counter()
        if self.dist.is_main:
            self._emit("on_rollout_end", run=run, step=step, trajectories=trajectories)
            result = self._score(trajectories)
            rewards = torch.tensor([r if r is not None else 0.0 for r in result.total], dtype=torch.float32)  # (B,)
            sample_mask = torch.tensor([r is not None for r in result.total], dtype=torch.float32)  # (B,)
            self._emit("on_rewards", run=run, step=step, trajectories=trajectories, rewards=rewards)
        else:
            result = rewards = sample_mask = None
        if self.dist.active:  # the main rank's rewards (after on_rewards edits) for everyone
            trajectories, result, rewards, sample_mask = self.dist.broadcast((trajectories, result, rewards, sample_mask))
        timings["reward"] = time.perf_counter() - mark

        mark = time.perf_counter()
        batch = collate(trajectories, pad_token_id=w.pad_token_id, rewards=rewards * sample_mask,
                        sample_mask=sample_mask)
        batch = self._make_experience(batch)
        timings["experience"] = time.perf_counter() - mark

        mark = time.perf_counter()
        metrics = w.policy.fit(batch, step=step)
        if w.critic is not None:
            metrics.update(w.critic.fit(batch, step=step))
        self._check_finite()
        timings["train"] = time.perf_counter() - mark

        mark = time.perf_counter()
        w.rollout.sync_weights(None)  # in-process engines share the weights; others get them pushed
        timings["sync"] = time.perf_counter() - mark
        timings["step"] = time.perf_counter() - started
        return self._metrics(trajectories, batch, result, metrics, timings)

    def _gather_trajectories(self, local: list, num_prompts: int) -> list:
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

    def _score(self, trajectories: list) -> Any:
        """Reward sources plus each trajectory's environment reward (the sum of its step rewards)."""
        env_rewards = [float(t.info.get("env_reward", 0.0)) for t in trajectories]
        if self.w.reward is None:  # the environment is the only reward
            result = RewardTotals(total=list(env_rewards), per_source={}, metrics={})
        else:
            result = self.w.reward.score(trajectories)
            if any(env_rewards):
                result.total = [t + e if t is not None else None for t, e in zip(result.total, env_rewards)]
        for index, trajectory in enumerate(trajectories):
            trajectory.reward = result.total[index]
            trajectory.rewards = {name: scores[index] for name, scores in result.per_source.items()}
            if "env" in trajectory.info:
                trajectory.rewards["env"] = env_rewards[index]
        return result

    # --- experience ---------------------------------------------------------------------------

    def _make_experience(self, batch: ExperienceBatch) -> ExperienceBatch:
        from rlhf.algorithms import compute_advantages, kl_divergence

        w, algo = self.w, self.w.algorithm
        old = w.policy.logprobs(batch) if self.recompute_old else None  # (B, A)
        ref = w.reference.logprobs(batch) if w.reference is not None else None  # (B, A)
        values = w.critic.values(batch) if w.critic is not None else None  # (B, A)
        kl = None
        if old is not None and ref is not None:
            kl = kl_divergence(algo.kl_estimator, old, ref) * batch.action_mask  # (B, A)
        advantages, returns = compute_advantages(
            algo.advantage, rewards=batch.rewards, action_mask=batch.action_mask,
            group_size=self.config.n_samples, values=values,
            kl=kl if algo.kl_in == "reward" else None, kl_coef=algo.kl_coef if algo.kl_in == "reward" else 0.0,
            sample_mask=batch.sample_mask.bool(), config=w.advantage_config, plugins=self.plugins,
        )
        return ExperienceBatch(**{**batch.__dict__, "old_logprobs": old, "ref_logprobs": ref, "values": values,
                                  "kl": kl, "advantages": advantages, "returns": returns})

    def _check_finite(self) -> None:
        for name in ("policy", "critic"):
            worker = getattr(self.w, name)
            if worker is not None and worker.nonfinite_in_a_row >= self.config.max_nonfinite_steps:
                raise RlhfError(
                    f"the {name} loss or gradient was NaN/inf for {worker.nonfinite_in_a_row} optimizer steps in a "
                    "row (each was skipped); lower --lr, check the rewards, or raise --max-nonfinite-steps")

    def _metrics(self, trajectories: list, batch: ExperienceBatch, result: Any, train: dict[str, float],
                 timings: dict[str, float]) -> dict[str, float]:
        mask = batch.sample_mask.bool()
        scored = batch.rewards[mask]
        lengths = torch.tensor([t.num_policy_tokens for t in trajectories], dtype=torch.float32)
        metrics: dict[str, float] = dict(result.metrics)  # per source; the totals below are what the loss used
        metrics.update({
            "reward/mean": float(scored.mean()) if scored.numel() else float("nan"),
            "reward/std": float(scored.std()) if scored.numel() > 1 else 0.0,
            "reward/skipped": float((~mask).sum()),
            "response/length_mean": float(lengths.mean()),
            "response/truncated_rate": sum(t.finish_reason == "length" for t in trajectories) / len(trajectories),
        })
        if batch.kl is not None:
            metrics["kl/mean"] = float(batch.kl.sum() / batch.action_mask.sum().clamp(min=1))
        elif "policy/kl" in train:
            metrics["kl/mean"] = train["policy/kl"]
        if any(t.num_turns > 1 or t.info.get("env") not in (None, "single_turn") for t in trajectories):
            metrics.update({
                "env/reward_mean": sum(t.info.get("env_reward", 0.0) for t in trajectories) / len(trajectories),
                "env/turns_mean": sum(t.num_turns for t in trajectories) / len(trajectories),
                "env/time_s": sum(t.info.get("env_time_s", 0.0) for t in trajectories),
                "env/budget_rate": sum(t.finish_reason == "budget" for t in trajectories) / len(trajectories),
                "env/env_tokens_mean": sum(len(t.token_ids) - t.prompt_length - t.num_policy_tokens
                                           for t in trajectories) / len(trajectories),
            })
        metrics.update(train)
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        metrics["throughput/tokens_per_s"] = float(lengths.sum()) / max(timings["step"], 1e-9)
        return metrics

    # --- run directory and checkpoints --------------------------------------------------------

    def _prepare_out_dir(self) -> None:
        if self.out.exists() and any(self.out.iterdir()) and not self.config.resume:
            raise RlhfError(f"{self.out} already holds a run: pass --resume to continue it, or choose another --out")
        self.out.mkdir(parents=True, exist_ok=True)
        import yaml

        (self.out / "config.yaml").write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))
        records = [r.to_json() for r in self.plugins.records if r.loaded]
        (self.out / "plugins.json").write_text(json.dumps({"fingerprint": self.w.fingerprint, "plugins": records},
                                                          indent=2))

    def _trained_workers(self) -> dict[str, Any]:
        """What a checkpoint holds: the trained workers, and the rollout when it keeps state of its own
        (the Ray runtime's rollout actors: their sampling RNG)."""
        chosen = {name: getattr(self.w, name) for name in ("policy", "critic") if getattr(self.w, name) is not None}
        if hasattr(self.w.rollout, "save"):
            chosen["rollout"] = self.w.rollout
        return chosen

    def _save_checkpoint(self, done: int) -> Path:
        state = {"loader": self.w.loader.state_dict(), "fingerprint": self.w.fingerprint,
                 "world_size": self.dist.world_size}
        return checkpoint.save_checkpoint(self.out, done, workers=self._trained_workers(), trainer_state=state,
                                          keep=self.config.keep_checkpoints, dist=self.dist)

    def _resume(self) -> None:
        from rlhf.core.fingerprint import fingerprint_differences

        path = checkpoint.latest_checkpoint(self.out)
        if path is None:
            log.warning("--resume: no complete checkpoint in %s; starting from step 0", self.out)
            return
        trainer_state = checkpoint.load_checkpoint(path, self._trained_workers(), self.dist)
        if trainer_state.get("world_size", 1) != self.dist.world_size:
            raise RlhfError(f"{path} was written by {trainer_state.get('world_size', 1)} processes; resume it with "
                            f"the same number (this run has {self.dist.world_size})")
        self.w.loader.load_state_dict(trainer_state["loader"])
        differences = fingerprint_differences(trainer_state["fingerprint"], self.w.fingerprint)
        if differences and self.dist.is_main:
            log.warning("resuming with a different plugin set than the checkpoint was written with:\n  %s",
                        "\n  ".join(differences))
        self.start_step = trainer_state["step"]
        log.info("resumed from %s (step %d)", path, self.start_step)
