"""Evaluation, one module for every command that evaluates: the RL loop (``rlhf train --eval-data``),
the fit loop (``rlhf sft``/``dpo``/... ``--eval-data``) and ``rlhf eval``.

* When: `EvalSchedule`, both loops (every ``--eval-every`` steps and after the last; the RL loop
  also before the first, the fit loop by default once per epoch).
* The sampled eval (the RL loop and ``rlhf eval``): the eval prompts sampled with the current
  policy (`sampled`), scored with the run's reward sources, and the ``eval/*`` metrics below
  (`metrics_of`): one definition for both commands.
* The fit loop's eval (`objective_eval`): the objective's loss and metrics over the eval examples,
  each micro-batch weighted by its units (tokens, pairs, ...), so the figures do not depend on
  ``--micro-batch-size``.

Metrics (``n`` = ``--eval-n-samples``): ``eval/reward/mean`` (mean total reward over scored
samples, before any reward shaping), ``eval/reward/<source>`` (each source's mean),
``eval/pass@n`` when n > 1 (mean over prompts of the best sample's reward: the share of prompts
solved at least once in n tries for 0/1 rewards, OpenRLHF's ``pass{n}``; not at temperature 0,
where the n samples are one greedy answer n times and pass@n would only repeat pass@1), ``eval/pass@1`` (mean
over prompts of the mean reward), ``eval/response/length_mean`` (policy tokens) and
``eval/response/truncated_rate``. Eval runs before the first step, every ``--eval-every`` steps
and after the last; sampling draws from the rollout's random stream, at the same points on a
resumed run, so resume stays exact (with ``--async``, from a random stream of eval's own).

`Evaluator` runs one sampled eval; `TrainingEvals` is the RL loop's side of them: when, ``on_eval``,
``--save-best``, and what the trainer state keeps. Under a launcher the rollout and reward roles
given here share the prompts out over the ranks and score on the main rank
(rlhf/runtime/rl/ranks.py): every rank gets the same figures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.core.outcomes import OUTCOMES, REWARD_ERROR, TRAINED
from rlhf.core.rewards import RewardResult
from rlhf.core.protocols.roles import RewardRole, RolloutRole
from rlhf.core.protocols.rollout import SamplingParams
from rlhf.core.types import Trajectory
from rlhf.runtime.run.best_model import BestModel
from rlhf.runtime.run.model_card import model_card
from rlhf.runtime.run.run_dir import RunDirectory


@dataclass(kw_only=True)
class Evaluator:
    prompts: list[Any]  # formatted eval prompt items
    n_samples: int
    every: int  # 0: only before the first step and after the last
    params: SamplingParams
    rollout: RolloutRole
    reward: RewardRole

    @classmethod
    def of_run(cls, config: Any, prompts: list[Any] | None, rollout: RolloutRole,
               reward: RewardRole) -> Evaluator | None:
        """The eval of an RL run (``config``: its `TrainConfig`) on ``prompts`` (None: no eval)."""
        if not prompts:
            return None
        temperature = config.eval_temperature if config.eval_temperature is not None else config.temperature
        params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=temperature, top_p=config.top_p,
                                top_k=config.top_k, repetition_penalty=config.repetition_penalty)
        return cls(prompts=prompts, n_samples=config.eval_n_samples, every=config.eval_every, params=params,
                   rollout=rollout, reward=reward)

    def due(self, done: int, total: int) -> bool:
        """Whether to evaluate after ``done`` completed steps (0: before training)."""
        return EvalSchedule(self.every, total, at_start=True).due(done)

    def run(self) -> dict[str, float]:
        trajectories, result = sampled(self.rollout, self.reward, self.prompts, self.n_samples, self.params)
        return metrics_of(trajectories, result, self.n_samples, greedy=self.params.temperature == 0)


@dataclass(frozen=True)
class EvalSchedule:
    """When a loop evaluates, after ``done`` of ``total`` steps: every ``every`` steps (0: never in
    between), after the last, and with ``at_start`` before the first (``done`` 0)."""

    every: int
    total: int
    at_start: bool = False

    def due(self, done: int) -> bool:
        return (self.at_start and done == 0) or done == self.total or (self.every > 0 and done > 0
                                                                          and done % self.every == 0)


def sampled(rollout: RolloutRole, reward: RewardRole, prompts: list[Any], n_samples: int, params: SamplingParams,
            batch_size: int | None = None, assign: bool = False) -> tuple[list[Trajectory], RewardResult]:
    """``n_samples`` completions of each prompt and their scores, ``batch_size`` prompts at a time
    (None: all in one call), the batches' results joined in prompt order (a source that scored no
    sample of a batch has None there). ``assign``: each batch's rewards written into its
    trajectories (`RewardResult.assign`)."""
    size = batch_size or max(len(prompts), 1)
    trajectories: list[Trajectory] = []
    total: list[float | None] = []
    per_source: dict[str, list[float | None]] = {}
    errors: dict[int, str] = {}
    result = RewardResult(total=[], per_source={}, metrics={})
    for begin in range(0, len(prompts), size):
        batch = rollout.generate(prompts[begin:begin + size], n=n_samples, params=params)
        result = reward.score(batch)
        if assign:
            result.assign(batch)
        if batch_size is None:  # one call: its result as it came
            return batch, result
        done = len(trajectories)
        trajectories += batch
        total += result.total
        errors.update({done + index: error for index, error in result.errors.items()})
        for name, scores in result.per_source.items():
            per_source.setdefault(name, [None] * done).extend(scores)
        for scores in per_source.values():
            scores.extend([None] * (len(trajectories) - len(scores)))
    return trajectories, RewardResult(total=total, per_source=per_source, metrics={}, errors=errors)


def objective_eval(objective: Any, models: Any, passes: list[tuple[dict[str, Any], bool]],
                   stats: dict[str, float], dist: Any) -> dict[str, float]:
    """The fit loop's eval: ``objective.loss`` on each of this rank's eval micro-batches (``passes``:
    ``(batch, counted)``; an uncounted one only keeps a sharded model's collectives in step), no
    grad, its loss and metrics averaged over every counted micro-batch of every rank weighted by
    the micro-batch's units: ``eval/loss`` and ``eval/<metric>``."""
    import torch

    from rlhf.runtime.step.weighted_means import WeightedMeans

    means = WeightedMeans()
    with torch.no_grad():
        for batch, counted in passes:
            loss, metrics = objective.loss(models, batch, stats)
            if counted:
                means.add({"loss": loss, **metrics}, float(objective.units(batch)))
    return {f"eval/{k}": v for k, v in means.result(dist).items()}


class TrainingEvals:
    """The RL loop's evals: each one when due (after ``done`` steps, `after`), in the random stream
    ``stream(state)`` gives (``--async``: eval's own, kept in ``state["rng"]``), its ``on_eval``
    event (``emit``), ``--save-best`` (the model written by ``export(directory)`` into
    ``<out>/best``, its card naming ``method``), and what a checkpoint keeps of them."""

    def __init__(self, evaluator: Evaluator | None, *, total_steps: int, save_best: str | None,
                 emit: Callable[..., None], stream: Callable[[dict[str, Any]], contextlib.AbstractContextManager[None]],
                 run_dir: RunDirectory, export: Callable[[Path], None], run_config: Callable[[], dict[str, Any]],
                 method: str):
        self.evaluator, self.total_steps, self.emit, self.stream = evaluator, total_steps, emit, stream
        self.run_dir, self.export, self.run_config, self.method = run_dir, export, run_config, method
        self.best_model = BestModel(save_best)
        self.last: dict[str, float] = {}  # the last eval's metrics
        self.stream_state: dict[str, Any] = {"rng": None}

    def after(self, done: int) -> dict[str, float]:
        """Eval after ``done`` steps when due (0: before the first); the last eval's metrics."""
        if self.evaluator is None or not self.evaluator.due(done, self.total_steps):
            return self.last
        with self.stream(self.stream_state):
            self.last = self.evaluator.run()
        self.emit("on_eval", step=done, metrics=self.last)
        self.best_model.consider(self.last, done, lambda record: self._write_best(done, record))
        return self.last

    def _write_best(self, done: int, record: dict[str, Any]) -> None:
        best = self.run_dir.path / "best"
        self.run_dir.write_model(best, self.export, record={"best.json": record}, card=model_card(
            self.run_config(), command="train", step=done, total_steps=self.total_steps, metrics=self.last, out=best,
            method=self.method, best=record["metric"]))

    def state_dict(self) -> dict[str, Any]:
        rng = self.stream_state["rng"]
        return {"best": self.best_model.record, "last_eval": self.last,
                "eval_rng": None if rng is None else [s.tolist() for s in rng]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        self.best_model.record, self.last = state.get("best"), state.get("last_eval") or {}
        if state.get("eval_rng") is not None:
            self.stream_state["rng"] = [torch.tensor(s, dtype=torch.uint8) for s in state["eval_rng"]]


def metrics_of(trajectories: list[Trajectory], result: RewardResult, n_samples: int, *,
               greedy: bool = False) -> dict[str, float]:
    """The ``eval/*`` metrics of scored trajectories (``n_samples`` contiguous rows per prompt); ``rlhf
    eval`` reports the same. A failed trajectory (`rlhf.core.outcomes`; ``reward_error`` where a
    source failed and left it without a reward) counts in ``eval/outcome/<outcome>_rate`` only,
    never in a reward figure. ``greedy`` (temperature 0): no ``eval/pass@n``, the samples being one."""
    metrics: dict[str, float] = {"eval/prompts": float(len(trajectories) // n_samples)}
    outcomes = [REWARD_ERROR if t.outcome in TRAINED and i in result.errors and result.total[i] is None
                else t.outcome for i, t in enumerate(trajectories)]
    totals = [r if o in TRAINED else None for r, o in zip(result.total, outcomes)]
    scored = [r for r in totals if r is not None]
    metrics["eval/reward/mean"] = sum(scored) / len(scored) if scored else float("nan")
    for name, values in result.per_source.items():
        used = [v for v, o in zip(values, outcomes) if v is not None and o in TRAINED]
        if used:
            metrics[f"eval/reward/{name}"] = sum(used) / len(used)
    best, mean = [], []
    for begin in range(0, len(totals), n_samples):
        group = [r for r in totals[begin:begin + n_samples] if r is not None]
        if group:
            best.append(max(group))
            mean.append(sum(group) / len(group))
    if mean:
        metrics["eval/pass@1"] = sum(mean) / len(mean)
        if n_samples > 1 and not greedy:
            metrics[f"eval/pass@{n_samples}"] = sum(best) / len(best)
    count = max(len(trajectories), 1)
    metrics["eval/response/length_mean"] = sum(t.num_policy_tokens for t in trajectories) / count
    metrics["eval/response/truncated_rate"] = sum(t.finish_reason in ("length", "budget")
                                                  for t in trajectories) / count
    for name in OUTCOMES:
        metrics[f"eval/outcome/{name}_rate"] = outcomes.count(name) / count
    return metrics
