"""The training loop (docs/architecture.md), the same for every runtime.

One step: a batch (prompts -> n trajectories each -> rewards -> tensors, made by
``rlhf.runtime.rl.batches``) -> experience (old/reference log-probs, values, KL) -> advantages ->
policy (and critic) updates -> weight sync -> log -> checkpoint.

The loop talks to the roles of `Workers` through the protocols of ``rlhf.core.protocols.roles``: the local
runtime fills it with in-process workers, the Ray runtime with handles on actor groups. Under a
launcher every rank runs this loop, and the roles it is given hide the ranks: the rollout shares
the prompts out and gathers every rank's trajectories, scoring runs on the main rank
(``rlhf/runtime/rl/ranks.py``), lifecycle events and warnings come from the main rank
(``rlhf/runtime/rl/events.py``), and every rank trains on its slice of each minibatch
(``rlhf/core/distributed.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlhf.algorithms.kl_control import KLController
from rlhf.core.distributed import SINGLE, DistContext
from rlhf.core.plugin_host.fingerprint import plugin_fingerprint
from rlhf.core.plugin_host.loading import PluginSet
from rlhf.core.protocols.roles import CriticRole, PolicyRole, ReferenceRole, RewardRole, RolloutRole, TrainedRole
from rlhf.core.types import RunInfo
from rlhf.runtime.config.train_plan import RunPlan
from rlhf.runtime.rl.async_generation import AsyncParts, async_batches
from rlhf.runtime.rl.batches import Batches, BatchSteps, SyncBatches
from rlhf.runtime.rl.events import Events
from rlhf.runtime.rl.experience import ExperienceMaker, row_metadata, source_rewards
from rlhf.runtime.rl.guards import StepGuards
from rlhf.runtime.rl.scoring import Scoring
from rlhf.runtime.rl.step_metrics import Timer, sequence_kl, step_metrics
from rlhf.runtime.rl.token_log import TokenLog
from rlhf.runtime.run.data import PromptLoader
from rlhf.runtime.run.evaluation import Evaluator, TrainingEvals
from rlhf.runtime.run.lifecycle import SteppedLoop, run_loop
from rlhf.runtime.run.progress import RL_FIELDS
from rlhf.runtime.run.run_dir import RunDirectory
from rlhf.runtime.step.segments import with_segments


@dataclass(kw_only=True)
class Workers:
    """Everything the loop drives. ``reference`` and ``critic`` are None when the run needs none."""

    policy: PolicyRole
    rollout: RolloutRole
    reward: RewardRole  # the eval's
    scoring: Scoring  # a batch's: the reward sources, shaping, the sample filter (or their main-rank wrapper)
    reference: ReferenceRole | None = None
    teacher: ReferenceRole | None = None  # --teacher: the frozen teacher's log-probs (on-policy distillation)
    critic: CriticRole | None = None
    loader: PromptLoader
    pad_token_id: int
    # (policy directory, critic directory or None for <out>/critic): writes the policy there, and
    # --save-critic's critic; called on every rank
    export: Callable[[Path, Path | None], None]
    dist: DistContext = SINGLE  # data-parallel ranks when started by a launcher (every rank runs this loop)
    prompt_multiple: int = 1  # a generate call's prompts come in multiples of this (a launcher's ranks: one share each)
    eval_prompts: list[Any] | None = None  # formatted --eval-data prompts (None: no eval)
    async_parts: AsyncParts | None = None  # what --async needs (None: this runtime does not support it)
    # the policy's weights are whole in this process (the local runtime, one process), so tokens.jsonl
    # may compute the log-probs of its rows when the step computed none (`rlhf.runtime.rl.token_log`)
    policy_here: bool = False

    @property
    def trained(self) -> dict[str, TrainedRole]:
        """The roles that train, by name."""
        return {name: role for name, role in (("policy", self.policy), ("critic", self.critic)) if role is not None}


class Trainer(SteppedLoop):
    def __init__(self, plan: RunPlan, plugins: PluginSet, workers: Workers):
        self.plan, self.config, self.plugins, self.workers = plan, plan.config, plugins, workers
        self.dist = workers.dist  # the lifecycle's (the run directory, checkpoints); the roles hide the ranks
        self.run_dir = RunDirectory(plan.derived.out_dir, self.dist)
        self.total_steps = plan.total_steps(len(workers.loader))
        self.experience = ExperienceMaker(
            plan.algorithm, plan.advantage_config, n_samples=self.config.n_samples,
            recompute_old=plan.algorithm.needs_old_logprobs(plan.derived.optimizer_steps_per_step),
            teacher_coef=self.config.teacher_coef if self.config.teacher_coef is not None else 1.0)
        self.fingerprint = plugin_fingerprint(plugins)
        self.start_step = 0
        algorithm = plan.algorithm
        self.kl = KLController(algorithm.kl_coef, self.config.kl_target if algorithm.needs_reference else None,
                               self.config.kl_horizon)
        self.events = Events(plugins, self.dist)
        # tokens.jsonl for `rlhf view` (the tokenizer is the prompt loader's, in every runtime)
        tokenizer = getattr(getattr(workers.loader, "formatter", None), "tokenizer", None)
        self.tokens = TokenLog(self.config.log_tokens, tokenizer, enabled=self.dist.is_main and tokenizer is not None)
        self.loss_reads_rollout_logprobs = plan.rollout_logprobs  # else the engine's are for tokens.jsonl only
        self.guards = StepGuards(plan, workers.trained, self.events)
        steps = BatchSteps(plan, scoring=workers.scoring, loader=workers.loader, pad_token_id=workers.pad_token_id,
                           events=self.events, prompt_multiple=workers.prompt_multiple)
        self.batches: Batches = (async_batches(plan, steps, workers.rollout, workers.async_parts, self.total_steps)
                                 if self.config.async_rollout else SyncBatches(steps, workers.rollout))
        # the lifecycle's: whether a stop between scheduled checkpoints may write one (not with --partial-rollouts)
        self.can_checkpoint = self.batches.can_checkpoint
        self.evals = TrainingEvals(
            Evaluator.of_run(self.config, workers.eval_prompts, workers.rollout, workers.reward),
            total_steps=self.total_steps, save_best=self.config.save_best, emit=self.events.emit,
            stream=self.batches.eval_stream, run_dir=self.run_dir, export=lambda tmp: workers.export(tmp, None),
            run_config=plan.run_config, method=self.method())

    # --- the run --------------------------------------------------------------------------------

    def run(self) -> Path:
        """The run's lifecycle (``rlhf.runtime.run.lifecycle``): resume, steps, checkpoints, ``final/``."""
        fields = RL_FIELDS + ((("eval", "eval/reward/mean", ".3f"),) if self.evals.evaluator is not None else ())
        return run_loop(self, config=self.plan.run_config(), resume=self.config.resume,
                        save_every=self.config.save_every, keep_checkpoints=self.config.keep_checkpoints,
                        progress=self.config.progress, command="train", fields=fields,
                        save_hf_every=self.config.save_hf_every)

    # the lifecycle's calls (rlhf.runtime.run.lifecycle.SteppedLoop)

    def begin(self, run: RunInfo) -> None:
        self.events.run = run
        self.batches.start(self.start_step)
        if self.start_step == 0:
            self.evals.after(0)

    def run_step(self, step: int, run: RunInfo) -> dict[str, float]:
        metrics = self.step(step, run)
        self.guards.check_rewards(step, metrics)
        return metrics

    def after_step(self, done: int, run: RunInfo) -> dict[str, float]:
        return self.evals.after(done)  # when due: on_eval, --save-best

    def before_checkpoint(self, done: int) -> None:
        self.batches.quiesce(done)  # --async: the batches in flight, made, go into the checkpoint

    def after_checkpoint(self, done: int) -> None:
        self.batches.publish(done)  # --async: the weights of version `done`, for the batches that need them

    def end(self) -> None:
        self.batches.close()
        self.tokens.close()

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
        prepared = self.batches.next(step)  # sampled, scored, filtered, collated (--async: made ahead)
        timer.seconds.update(prepared.seconds)  # its rollout and reward time
        trajectories, batch = prepared.trajectories, prepared.batch
        if batch.rollout_logprobs is not None and not self.loss_reads_rollout_logprobs:
            batch = replace(batch, rollout_logprobs=None)  # asked for tokens.jsonl only: the update does not see them
        with timer("experience"):
            batch = self.experience.make(batch, w.policy, w.reference, w.critic, kl_coef=self.kl.value,
                                         source_rewards=source_rewards(trajectories),
                                         metadata=[row_metadata(t) for t in trajectories], teacher=w.teacher)
            batch = with_segments(batch, trajectories, pad_token_id=w.pad_token_id, policy=w.policy,
                                  reference=w.reference, critic=w.critic,
                                  kl_estimator=self.plan.algorithm.kl_estimator, teacher=w.teacher,
                                  teacher_coef=self.experience.teacher_coef)  # --agent branches
            frozen = step < self.config.freeze_actor_steps  # critic warm-up: the policy waits
            # --log-tokens (rlhf view's token view): the logged rows' log-probs from the update's own
            # forwards where it can keep them (`PolicyWorker.keep_logprobs`), else a forward of their own
            logged = min(self.tokens.limit, len(trajectories)) if self.tokens.enabled else 0
            from_update = bool(logged) and w.policy_here and not frozen and w.policy.keep_logprobs(batch, logged)
            if not from_update:
                self.tokens.write(run, step, trajectories, batch, policy=w.policy if w.policy_here else None)
        with timer("train"):
            train = {"policy/frozen": 1.0} if frozen else {**w.policy.fit(batch, step=step, kl_coef=self.kl.value),
                                                            "policy/frozen": 0.0}
            if w.critic is not None:
                train.update(w.critic.fit(batch, step=step))
            self.guards.check_finite()
        if from_update:
            self.tokens.write(run, step, trajectories, batch, kept=w.policy.kept)
        with timer("sync"):
            if not frozen:
                self.batches.sync_weights()  # the rollout samples from the new weights (--async: by version)
        metrics = step_metrics(trajectories, batch, prepared.reward_metrics, train, timer.done())
        metrics["kl/beta"] = self.kl.value
        metrics.update(prepared.metrics)  # --async: staleness, waits
        metrics.update(prepared.outcome_metrics)  # outcome/<outcome>_rate, outcome/retries
        self.kl.update(sequence_kl(batch, metrics), batch.size)
        return metrics

    # --- checkpoints ----------------------------------------------------------------------------

    def checkpoint_roles(self) -> dict[str, Any]:
        """What a checkpoint holds: the trained roles, and batch making's (the rollout when it keeps
        state of its own; --async: the batches in flight)."""
        return {**self.workers.trained, **self.batches.checkpoint_roles()}

    def trainer_state(self) -> dict[str, Any]:
        return {"loader": self.workers.loader.state_dict(), "fingerprint": self.fingerprint,
                "world_size": self.dist.world_size, "kl": self.kl.state_dict(), **self.evals.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.workers.loader.load_state_dict(state["loader"])
        if "kl" in state:
            self.kl.load_state_dict(state["kl"])
        self.evals.load_state_dict(state)
