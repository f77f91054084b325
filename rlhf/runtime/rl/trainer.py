"""The training loop (docs/architecture.md), the same for every runtime.

One step: G prompts -> n trajectories each -> rewards -> experience (old/reference log-probs,
values, KL) -> advantages -> policy (and critic) updates -> weight sync -> log -> checkpoint.

The loop talks to the roles of `Workers` through the protocols of ``rlhf.core.protocols.roles``: the local
runtime fills it with in-process workers, the Ray runtime with handles on actor groups. Under a
launcher every rank runs this loop: prompts are split over the ranks for generation, rewards are
scored and lifecycle events fired on the main rank, and every rank trains on its slice of each
minibatch (``rlhf/core/distributed.py``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.algorithms.kl_control import KLController
from rlhf.core.batch import collate
from rlhf.core.distributed import SINGLE, DistContext, unshard
from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.fingerprint import plugin_fingerprint
from rlhf.core.plugin_host.loading import PluginSet
from rlhf.core.protocols.roles import CriticRole, PolicyRole, ReferenceRole, RewardRole, RolloutRole
from rlhf.core.protocols.rollout import SamplingParams
from rlhf.core.types import RunInfo, Trajectory
from rlhf.runtime.rl.async_generation import AsyncGeneration, AsyncParts, PipelineStages, Prepared, Rolled
from rlhf.runtime.run.best_model import BestModel
from rlhf.runtime.run.data import PromptLoader
from rlhf.runtime.run.evaluation import Evaluator
from rlhf.runtime.rl.experience import ExperienceMaker, row_metadata, source_rewards
from rlhf.runtime.config.train_plan import RunPlan
from rlhf.runtime.run.lifecycle import SteppedLoop, run_loop
from rlhf.runtime.run.model_card import model_card
from rlhf.runtime.run.progress import RL_FIELDS
from rlhf.runtime.run.run_dir import RunDirectory
from rlhf.runtime.rl.step_metrics import merge_round_metrics, sequence_kl, step_metrics
from rlhf.runtime.run.threads import split_threads
from rlhf.runtime.step.trained import check_nonfinite_limit

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
    # (policy directory, critic directory or None for <out>/critic): writes the policy there, and
    # --save-critic's critic; called on every rank
    export: Callable[[Path, Path | None], None]
    dist: DistContext = SINGLE  # data-parallel ranks when started by a launcher (every rank runs this loop)
    eval_prompts: list[Any] | None = None  # formatted --eval-data prompts (None: no eval)
    async_parts: AsyncParts | None = None  # what --async needs (None: this runtime does not support it)


class Timer:
    """Seconds per phase of a step, and the whole step."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        began = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - began

    def done(self) -> dict[str, float]:
        return {**self.seconds, "step": time.perf_counter() - self.started}


class Trainer(SteppedLoop):
    def __init__(self, plan: RunPlan, plugins: PluginSet, workers: Workers):
        self.plan, self.config, self.plugins, self.workers = plan, plan.config, plugins, workers
        self.dist = workers.dist
        self.run_dir = RunDirectory(plan.derived.out_dir, self.dist)
        self.total_steps = plan.total_steps(len(workers.loader))
        self.sampling = SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=self.config.temperature,
                                       top_p=self.config.top_p, top_k=self.config.top_k,
                                       repetition_penalty=self.config.repetition_penalty,
                                       return_logprobs=plan.rollout_logprobs)
        self.experience = ExperienceMaker(
            plan.algorithm, plan.advantage_config, n_samples=self.config.n_samples,
            recompute_old=plan.algorithm.needs_old_logprobs(plan.derived.optimizer_steps_per_step))
        self.fingerprint = plugin_fingerprint(plugins)
        self.start_step = 0
        self.failed_reward_steps = 0  # steps in a row where a reward source failed on every sample
        algorithm = plan.algorithm
        self.kl = KLController(algorithm.kl_coef, self.config.kl_target if algorithm.needs_reference else None,
                               self.config.kl_horizon)
        self.sample_filter = plan.sample_filter() if self.dist.is_main else None
        self.shapings = plan.reward_shapings(plugins) if self.dist.is_main else []
        self.evaluator = self._evaluator()
        self.best_model = BestModel(self.config.save_best)  # --save-best
        self.last_eval: dict[str, float] = {}
        self.hooks_lock = threading.RLock()
        self.async_generation = self._async_generation() if self.config.async_rollout else None
        # async: eval samples from a stream of its own, so the producer's stays deterministic
        self.eval_stream: dict[str, Any] = {"rng": None}

    # --- the run --------------------------------------------------------------------------------

    def run(self) -> Path:
        """The run's lifecycle (``rlhf.runtime.run.lifecycle``): resume, steps, checkpoints, ``final/``."""
        fields = RL_FIELDS + ((("eval", "eval/reward/mean", ".3f"),) if self.evaluator is not None else ())
        return run_loop(self, config=self.plan.run_config(), resume=self.config.resume,
                        save_every=self.config.save_every, keep_checkpoints=self.config.keep_checkpoints,
                        progress=self.config.progress, command="train", fields=fields,
                        save_hf_every=self.config.save_hf_every)

    # the lifecycle's calls (rlhf.runtime.run.lifecycle.SteppedLoop)

    def begin(self, run: RunInfo) -> None:
        self._run_info = run
        if self.async_generation is not None:
            self.async_generation.start(self.start_step)
        if self.start_step == 0:
            self._evaluate(0, run)

    def run_step(self, step: int, run: RunInfo) -> dict[str, float]:
        metrics = self.step(step, run)
        self._check_rewards(step, metrics)
        return metrics

    def after_step(self, done: int, run: RunInfo) -> dict[str, float]:
        self._evaluate(done, run)
        return self.last_eval

    def before_checkpoint(self, done: int) -> None:
        if self.async_generation is not None:
            self.async_generation.quiesce(done)  # the in-flight batches, made, go into the checkpoint

    def after_checkpoint(self, done: int) -> None:
        if self.async_generation is not None:
            self.async_generation.publish(done)

    def end(self) -> None:
        if self.async_generation is not None:
            self.async_generation.close()

    def method(self) -> str:
        names = self.plan.algorithm.names()
        return (f"`{names['algo']}` (RL: advantage `{names['advantage']}`, policy loss `{names['policy_loss']}`, "
                f"KL `{names['kl_estimator']}` in the {names['kl_in']} with β {names['kl_coef']}, aggregation "
                f"`{names['loss_agg']}`)")

    def export_final(self, directory: Path, card: str) -> None:
        self.run_dir.write_model(directory, lambda tmp: self.workers.export(tmp, None), card=card)

    def export_hf(self, directory: Path) -> None:
        self.workers.export(directory / "hf", directory / "hf_critic")

    def step(self, step: int, run: RunInfo) -> dict[str, float]:
        w, timer = self.workers, Timer()
        if self.async_generation is None:
            prepared = self._prepare(step, run, w.rollout, timer)
            extra: dict[str, float] = {}
        else:
            prepared, waited = self.async_generation.next(step)
            timer.seconds.update(prepared.seconds)  # the producer's rollout and reward time for this batch
            staleness = float(step - prepared.version)
            extra = {"async/staleness_mean": staleness, "async/staleness_max": staleness, "async/wait_s": waited,
                     "async/idle_s": prepared.idle_s, "async/version": float(prepared.version)}
        trajectories, batch, reward_metrics = prepared.trajectories, prepared.batch, prepared.reward_metrics
        with timer("experience"):
            batch = self.experience.make(batch, w.policy, w.reference, w.critic, kl_coef=self.kl.value,
                                         source_rewards=source_rewards(trajectories),
                                         metadata=[row_metadata(t) for t in trajectories])
        with timer("train"):
            frozen = step < self.config.freeze_actor_steps  # critic warm-up: the policy waits
            train = {"policy/frozen": 1.0} if frozen else {**w.policy.fit(batch, step=step, kl_coef=self.kl.value),
                                                            "policy/frozen": 0.0}
            if w.critic is not None:
                train.update(w.critic.fit(batch, step=step))
            self._check_finite()
        with timer("sync"):
            if not frozen and self.async_generation is None:  # --async: the producer takes weights by version
                w.rollout.sync_weights()  # in-process engines share the weights; others get them pushed
        metrics = step_metrics(trajectories, batch, reward_metrics, train, timer.done())
        metrics["kl/beta"] = self.kl.value
        metrics.update(extra)
        self.kl.update(sequence_kl(batch, metrics), batch.size)
        return metrics

    def _prepare(self, step: int, run: RunInfo, rollout: RolloutRole, timer: Timer | None = None) -> Prepared:
        """The batch of a step: prompt groups sampled, scored, shaped and filtered (`_collect`), the
        ``on_rewards`` event, then collated. ``rollout``: the trainer's, or (--async) the producer's."""
        timer = timer or Timer()
        trajectories, reward_metrics = self._collect(step, run, timer, rollout)
        return self._collated(step, run, trajectories, reward_metrics, timer)

    def _collated(self, step: int, run: RunInfo, trajectories: list[Trajectory], reward_metrics: dict[str, float],
                  timer: Timer) -> Prepared:
        """The scored batch of a step as tensors, after the ``on_rewards`` event."""
        with timer("experience"):
            rewards = torch.tensor([t.reward if t.reward is not None else 0.0 for t in trajectories],
                                   dtype=torch.float32)  # (B,)
            sample_mask = torch.tensor([t.reward is not None for t in trajectories], dtype=torch.float32)  # (B,)
            self._emit("on_rewards", run=run, step=step, trajectories=trajectories, rewards=rewards)
            batch = collate(trajectories, pad_token_id=self.workers.pad_token_id, rewards=rewards * sample_mask,
                            sample_mask=sample_mask)
        return Prepared(step=step, version=step, trajectories=trajectories, batch=batch, reward_metrics=reward_metrics,
                        seconds=dict(timer.seconds))

    def _collect(self, step: int, run: RunInfo, timer: Timer,
                 rollout: RolloutRole) -> tuple[list[Trajectory], dict[str, float]]:
        """Sample, score and shape ``--prompts-per-step`` prompt groups; with a sample filter, drop the
        groups it rejects and sample new prompts until enough are kept (``--max-filter-rounds``)."""
        config, n = self.config, self.config.n_samples
        wanted = config.prompts_per_step
        kept: list[list[Trajectory]] = []
        rounds = dropped = sampled = 0
        metrics: list[tuple[dict[str, float], int]] = []
        last: list[list[Trajectory]] = []
        while len(kept) < wanted and rounds < (config.max_filter_rounds if self.plan.filters_groups else 1):
            rounds += 1
            need = wanted - len(kept)
            need += -need % self.dist.dp_size  # every data-parallel rank generates the same number of prompts
            with timer("rollout"):
                trajectories = self._roll(need, rollout)
            with timer("reward"):
                trajectories, keep, round_metrics = self._score(step, run, trajectories)
            groups = [trajectories[i:i + n] for i in range(0, len(trajectories), n)]
            sampled += len(groups)
            dropped += keep.count(False)
            metrics.append((round_metrics, len(trajectories)))
            kept += [g for g, k in zip(groups, keep) if k]
            last = groups
        return self._kept(step, kept, last, rounds=rounds, sampled=sampled, dropped=dropped, metrics=metrics)

    def _roll(self, need: int, rollout: RolloutRole) -> list[Trajectory]:
        """``need`` prompts' groups sampled (split over the ranks), in prompt order."""
        prompts = self.workers.loader.next_batch(need)  # the same on every rank
        local = rollout.generate(self.dist.shard(prompts), n=self.config.n_samples, params=self.sampling)
        return self._gather(local, len(prompts))

    def _kept(self, step: int, kept: list[list[Trajectory]], last: list[list[Trajectory]], *, rounds: int,
              sampled: int, dropped: int, metrics: list[tuple[dict[str, float], int]]
              ) -> tuple[list[Trajectory], dict[str, float]]:
        """The groups a step trains on, renumbered, and the rounds' reward (and filter) metrics."""
        wanted = self.config.prompts_per_step
        if self.plan.filters_groups:
            if not kept:
                log.warning("step %d: no prompt group passed the sample filter in %d rounds; training on the last "
                            "round's groups unfiltered", step + 1, rounds)
                kept = last
            elif len(kept) < wanted:
                log.warning("step %d: %d of %d prompt groups passed the sample filter in %d rounds (--max-filter-"
                            "rounds); training on those", step + 1, len(kept), wanted, rounds)
        kept = kept[:wanted]
        trajectories = []
        for index, group in enumerate(kept):
            for trajectory in group:
                trajectory.group = index
                trajectories.append(trajectory)
        merged = merge_round_metrics(metrics)
        if self.plan.filters_groups:
            merged.update({"filter/rounds": float(rounds), "filter/dropped_groups": float(dropped),
                           "filter/kept_groups": float(len(kept)), "filter/sampled_groups": float(sampled),
                           "filter/pass_rate": (sampled - dropped) / max(sampled, 1)})
        return trajectories, merged

    # --- the pieces of a step -------------------------------------------------------------------

    def _gather(self, local: list[Trajectory], num_prompts: int, n: int | None = None) -> list[Trajectory]:
        """Every rank's trajectories in prompt order (``n`` per prompt, default ``--n-samples``), with
        groups renumbered to the whole batch."""
        if not self.dist.active:
            return local
        n = n or self.config.n_samples
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
        """Rewards on the main rank, after the rollout event: each trajectory's ``reward`` (shaped;
        None: dropped from the loss), ``rewards`` and ``score``, then the sample filter's verdict
        per prompt group. Every rank gets ``(trajectories, keep (one bool per group), metrics)``."""
        if self.dist.is_main:
            self._emit("on_rollout_end", run=run, step=step, trajectories=trajectories)
            scored = self._judge(trajectories, self.workers.reward.score(trajectories))
        else:
            scored = None
        return self.dist.broadcast(scored) if self.dist.active else scored

    def _judge(self, trajectories: list[Trajectory], result: Any) -> tuple[Any, ...]:
        """The reward sources' result written into the trajectories, shaped, and the sample filter's
        verdict per prompt group: ``(trajectories, keep, metrics)``."""
        result.assign(trajectories)
        metrics = dict(result.metrics)
        totals = [t.reward for t in trajectories]
        for name, shaping, shaping_config in self.shapings:
            totals, shaping_metrics = shaping(trajectories, totals, shaping_config)
            if len(totals) != len(trajectories):
                raise RlhfError(f"reward shaping {name!r} returned {len(totals)} rewards for "
                                f"{len(trajectories)} trajectories")
            metrics.update(shaping_metrics)
        for trajectory, total in zip(trajectories, totals):
            trajectory.reward = None if total is None else float(total)
        n = self.config.n_samples
        groups = [trajectories[i:i + n] for i in range(0, len(trajectories), n)]
        keep = [True] * len(groups)
        if self.sample_filter is not None:
            sample_filter, filter_config = self.sample_filter
            keep = [bool(k) for k in sample_filter(groups, filter_config)]
            if len(keep) != len(groups):
                raise RlhfError(f"sample filter {self.plan.choices['sample_filter'].name!r} returned {len(keep)} "
                                f"flags for {len(groups)} prompt groups")
        return trajectories, keep, metrics

    # --- async ----------------------------------------------------------------------------------

    def _async_generation(self) -> AsyncGeneration:
        parts = self.workers.async_parts
        if parts is None:
            raise RlhfError("--async is not available with this runtime yet: use the local runtime")
        staleness = self.config.max_staleness
        # A sample filter decides from a batch's rewards whether to sample more prompts for the same
        # step, so that step's scoring cannot run beside the next step's generation.
        pipelined = not self.plan.filters_groups and not self.dist.active
        stages = PipelineStages(rollout=self._pipelined_rollout, rollout_end=self._pipelined_rollout_end,
                                score=self._pipelined_score, finish=self._pipelined_finish) if pipelined else None
        # continuously batched rollouts leave the random stream early: up to K batches roll out at once
        lanes = staleness if parts.rollouts_overlap else 1
        return AsyncGeneration(parts=parts, prepare=lambda step, rollout: self._prepare(step, self._run_info, rollout),
                               stages=stages, max_staleness=staleness, total_steps=self.total_steps,
                               pad_token_id=self.workers.pad_token_id,
                               threads=split_threads(torch.get_num_threads(), staleness), lanes=lanes)

    # The pipelined stages (--async without a sample filter): what `_prepare` does, in three parts that
    # run on three threads; together they give the same batch as `_prepare`, bit for bit.

    def _pipelined_rollout(self, step: int, rollout: RolloutRole) -> Rolled:
        """Stage 1 (a generation thread; its random draws in step order): sample the step's prompt groups."""
        timer = Timer()
        with timer("rollout"):
            trajectories = self._roll(self.config.prompts_per_step, rollout)
        return Rolled(step=step, trajectories=trajectories, seconds=dict(timer.seconds))

    def _pipelined_rollout_end(self, rolled: Rolled) -> Rolled:
        """Stage 1, end (in step order): ``on_rollout_end``, then tensors for the behaviour log-probs
        (the rewards come in stage 3)."""
        self._emit("on_rollout_end", run=self._run_info, step=rolled.step, trajectories=rolled.trajectories)
        size = len(rolled.trajectories)
        rolled.batch = collate(rolled.trajectories, pad_token_id=self.workers.pad_token_id, rewards=torch.zeros(size),
                               sample_mask=torch.ones(size))
        return rolled

    def _pipelined_score(self, rolled: Rolled) -> Any:
        """Stage 2 (a thread per batch, several batches at once): the reward sources' call."""
        began = time.perf_counter()
        result = self.workers.reward.score(rolled.trajectories)
        rolled.seconds["reward"] = time.perf_counter() - began
        return result

    def _pipelined_finish(self, rolled: Rolled, result: Any) -> Prepared:
        """Stage 3 (the finishing thread, in step order): shaping, ``on_rewards``, tensors."""
        timer = Timer()
        timer.seconds.update(rolled.seconds)
        with timer("reward"):
            trajectories, keep, metrics = self._judge(rolled.trajectories, result)
        n = self.config.n_samples
        groups = [trajectories[i:i + n] for i in range(0, len(trajectories), n)]
        trajectories, merged = self._kept(rolled.step, groups, groups, rounds=1, sampled=len(groups),
                                          dropped=keep.count(False), metrics=[(metrics, len(trajectories))])
        return self._collated(rolled.step, self._run_info, trajectories, merged, timer)

    # --- eval -----------------------------------------------------------------------------------

    def _evaluator(self) -> Evaluator | None:
        config = self.config
        if not self.workers.eval_prompts:
            return None
        temperature = config.eval_temperature if config.eval_temperature is not None else config.temperature
        params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=temperature, top_p=config.top_p,
                                top_k=config.top_k, repetition_penalty=config.repetition_penalty)
        return Evaluator(prompts=self.workers.eval_prompts, n_samples=config.eval_n_samples, every=config.eval_every,
                         params=params, rollout=self.workers.rollout, reward=self.workers.reward, gather=self._gather,
                         dist=self.dist)

    def _evaluate(self, done: int, run: RunInfo) -> None:
        """Eval after ``done`` steps when due: ``on_eval`` (metrics.jsonl rows), and ``--save-best``."""
        if self.evaluator is None or not self.evaluator.due(done, self.total_steps):
            return
        generation = self.async_generation
        with generation.separate_stream(self.eval_stream) if generation is not None else contextlib.nullcontext():
            self.last_eval = self.evaluator.run()
        self._emit("on_eval", run=run, step=done, metrics=self.last_eval)
        best = self.run_dir.path / "best"
        self.best_model.consider(self.last_eval, done, lambda record: self.run_dir.write_model(
            best, lambda tmp: self.workers.export(tmp, None), record={"best.json": record}, card=model_card(
                self.plan.run_config(), command="train", step=done, total_steps=self.total_steps,
                metrics=self.last_eval, out=best, method=self.method(), best=record["metric"])))

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
            role = getattr(self.workers, name)
            if role is not None:
                check_nonfinite_limit(role.nonfinite_in_a_row, self.config.max_nonfinite_steps, loss=f"the {name} loss",
                                      check="the rewards")

    def _emit(self, event: str, **kwargs: Any) -> None:
        if self.dist.is_main:
            with self.hooks_lock:  # --async: the pipeline's threads emit too; plugins see one call at a time
                self.plugins.emit(event, **kwargs)

    # --- checkpoints ----------------------------------------------------------------------------

    def checkpoint_roles(self) -> dict[str, Any]:
        """What a checkpoint holds: the trained roles, and the rollout when it keeps state of its own."""
        roles = {name: getattr(self.workers, name) for name in ("policy", "critic")
                 if getattr(self.workers, name) is not None}
        if self.workers.rollout.stateful:
            roles["rollout"] = self.workers.rollout
        if self.async_generation is not None:
            roles["in_flight"] = self.async_generation  # batches made, not yet trained (checkpoint's in_flight/)
        return roles

    def trainer_state(self) -> dict[str, Any]:
        return {"loader": self.workers.loader.state_dict(), "fingerprint": self.fingerprint,
                "world_size": self.dist.world_size, "kl": self.kl.state_dict(), "best": self.best_model.record,
                "last_eval": self.last_eval,
                "eval_rng": None if self.eval_stream["rng"] is None else [s.tolist() for s in self.eval_stream["rng"]]}

    def restore(self, state: dict[str, Any]) -> None:
        self.workers.loader.load_state_dict(state["loader"])
        if "kl" in state:
            self.kl.load_state_dict(state["kl"])
        self.best_model.record, self.last_eval = state.get("best"), state.get("last_eval") or {}
        if state.get("eval_rng") is not None:
            self.eval_stream["rng"] = [torch.tensor(s, dtype=torch.uint8) for s in state["eval_rng"]]

