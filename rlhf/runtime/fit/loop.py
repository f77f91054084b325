"""The fit loop (docs/objectives.md): one loop for every offline objective (SFT, RM, DPO, KTO, PRM, KD, ...).

One optimizer step:

1. its examples (`StepOrder`: a reshuffle per epoch, the same on every rank), through the
   objective's ``step_examples``;
2. split over ranks (rank r takes examples r, r + W, ...) and into micro-batches of
   ``--micro-batch-size`` examples (``collate``);
3. the step's units (tokens, pairs, ...: ``units``) summed over every micro-batch of every rank,
   and, when the objective has them, its step statistics (a no-grad pass, summed likewise);
4. per micro-batch, ``loss`` (a mean over its units) scaled by ``units / step units`` and handed
   to the backend's ``backward``: the accumulated gradient is that of the mean over the whole
   step, whatever the micro-batch size or the number of ranks (backends sum the ranks' shares);
5. the optimizer step (`TrainedModel.optimizer_step`, the RL workers' too), skipped on every rank
   when any rank's loss was NaN/inf;
6. metrics (weighted means over ranks), eval on ``--eval-data`` when due, ``--save-best``,
   lifecycle events and checkpoints, as in the RL loop.

Everything the loop needs from the objective is the contract of ``rlhf.core.protocols.objective``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.core.distributed import SINGLE, DistContext
from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.fingerprint import plugin_fingerprint
from rlhf.core.protocols.objective import FitModels, Objective
from rlhf.runtime.step.micro_batches import cut_by_length
from rlhf.core.plugin_host.loading import PluginSet
from rlhf.core.types import RunInfo
from rlhf.runtime.run.best_model import BestModel
from rlhf.runtime.run.evaluation import EvalSchedule, objective_eval
from rlhf.runtime.fit.data import StepOrder
from rlhf.runtime.config.fit_plan import FitPlan
from rlhf.runtime.run.lifecycle import SteppedLoop, run_loop
from rlhf.runtime.run.model_card import model_card
from rlhf.runtime.step.router_aux import RouterAux
from rlhf.runtime.run.run_dir import RunDirectory
from rlhf.runtime.run.threads import adjust_threads
from rlhf.runtime.step.weighted_means import WeightedMeans, sum_over_ranks
from rlhf.runtime.step.trained import TrainedModel, check_nonfinite_limit, forward_model

log = logging.getLogger(__name__)

PROGRESS_FIELDS = (("loss", "train/loss", ".4f"), ("eval", "eval/loss", ".4f"), ("lr", "train/lr", ".2e"))


@dataclass(kw_only=True)
class FitParts:
    """Everything the fit loop drives, built by the runtime (``rlhf.runtime.fit.local``)."""

    objective: Objective
    trained: TrainedModel  # the model being trained, with its backend
    reference: torch.nn.Module | None = None
    teacher: torch.nn.Module | None = None
    train_examples: list[Any]
    eval_examples: list[Any]
    pad_token_id: int
    export: Callable[[Path, dict[str, Any]], None]  # (directory, config.json entries); called on every rank
    dist: DistContext = SINGLE
    router_aux: RouterAux | None = None  # --aux-loss-coef: the MoE router loss of the training forwards


class FitLoop(SteppedLoop):
    def __init__(self, plan: FitPlan, plugins: PluginSet, parts: FitParts):
        self.plan, self.config, self.plugins, self.parts = plan, plan.config, plugins, parts
        self.dist = parts.dist
        self.objective = parts.objective
        self.trained = parts.trained
        self.run_dir = RunDirectory(self.config.out_dir, self.dist)
        self.order = StepOrder(len(parts.train_examples), self.config.batch_size, self.config.seed)
        self.total_steps = plan.total_steps
        self.fingerprint = plugin_fingerprint(plugins)
        self.best_model = BestModel(self.config.save_best)  # --save-best
        self.start_step = 0

    @property
    def models(self) -> FitModels:
        """The models as the objective's training forwards call them (packed with ``--packing``, over
        the ring with ``--ring-attn-size``). Prefix sharing steps aside under ``--aux-loss-coef``:
        its forwards take a 4D mask or are hand-written, and return no router logits over the real
        tokens. Packed, the shared rows run packed (`rlhf.fastpaths.prefix_sharing.packed_sharing`)."""
        ring, packing = self.dist.ring, self.config.packing
        models = tuple(forward_model(m, packing=packing, ring=ring) if m is not None else None
                       for m in (self.trained.train_model, self.parts.reference, self.parts.teacher))
        return FitModels(model=models[0], reference=models[1], teacher=models[2],
                         share_prompt=self.config.share_prompt and ring is None
                         and self.parts.router_aux is None)

    # --- the run --------------------------------------------------------------------------------

    def run(self) -> Path:
        """The run's lifecycle (``rlhf.runtime.run.lifecycle``): resume, steps, checkpoints, ``final/``."""
        return run_loop(self, config=self.plan.run_config(), resume=self.config.resume,
                        save_every=self.config.save_every, keep_checkpoints=self.config.keep_checkpoints,
                        progress=self.config.progress, command="fit", fields=PROGRESS_FIELDS,
                        save_hf_every=self.config.save_hf_every)

    def run_step(self, step: int, run: RunInfo) -> dict[str, float]:
        """A step, then the eval when it is due (and ``--save-best``)."""
        metrics = self.step(step)
        done = step + 1
        if self._eval_due(done):
            metrics.update(self.evaluate())
            best = self.run_dir.path / "best"
            self.best_model.consider(metrics, done, lambda record: self._export(best, record, card=model_card(
                self.plan.run_config(), command="fit", step=done, total_steps=self.total_steps, metrics=metrics,
                out=best, best=record["metric"])))
        return metrics

    def begin(self, run: RunInfo) -> None:
        """``--save-best``: a metric the eval does not report is a usage error now, not after training."""
        if self.best_model.metric is not None and self.parts.eval_examples:
            self.best_model.check(self._eval_metric_names())

    def export_final(self, directory: Path, card: str) -> None:
        self._export(directory, card=card)

    def export_hf(self, directory: Path) -> None:
        self.parts.export(directory / "hf", self.objective.output_config(self.final_statistics()))

    def step(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        adjust_threads()  # the CPU thread count follows the machine's load
        examples = self.objective.step_examples([self.parts.train_examples[i] for i in self.order.indices(step)])
        micros = self._micro_batches(self.dist.shard(examples))
        units = [float(self.objective.units(batch)) for batch in micros]
        step_units = sum(sum(part) for part in self.dist.all_gather(units))
        stats = self._statistics([(batch, True) for batch in micros], self.objective.step_statistics)
        trained, means = self.trained, WeightedMeans()
        trained.model.train()

        def share(batch: dict[str, Any], batch_units: float) -> tuple[torch.Tensor, dict[str, Any], float]:
            """A micro-batch's share of the step loss: its mean loss (plus C times its router loss with
            ``--aux-loss-coef``) scaled by its share of the units."""
            loss, metrics = (self.objective.loss(self.models, batch, stats) if self.parts.router_aux is None else
                             self.parts.router_aux.added(lambda: self.objective.loss(self.models, batch, stats)))
            return (loss * (batch_units / step_units) if step_units > 0 else loss * 0.0), metrics, batch_units

        trained.optimizer_step([lambda batch=batch, batch_units=batch_units: share(batch, batch_units)
                                for batch, batch_units in zip(micros, units)], means)
        metrics = {f"train/{k}": v for k, v in means.result(self.dist).items()}
        if metrics.get("train/skipped_steps"):
            check_nonfinite_limit(trained.nonfinite_in_a_row, self.config.max_nonfinite_steps, loss="the loss",
                                  check="the data")
            log.warning("step %d: the loss or gradient was NaN/inf; the optimizer step was skipped", step + 1)
        metrics["train/epoch"] = (step + 1) / self.order.steps_per_epoch
        metrics["train/units"] = step_units
        metrics["time/step"] = time.perf_counter() - started
        return metrics

    # --- passes over examples -------------------------------------------------------------------

    def _micro_batches(self, examples: list[Any]) -> list[dict[str, Any]]:
        """``--micro-batch-size`` examples each, or as many as fit ``--max-tokens-per-micro-batch``,
        of similar lengths (`cut_by_length`, the RL loop's cutter too)."""
        size, max_tokens = self.config.micro_batch_size, self.config.max_tokens_per_micro_batch
        device, pad = self.trained.device, self.parts.pad_token_id
        masks = [self._attention_mask(self.objective.collate([example], pad)) for example in examples]
        lengths = [int(mask.sum(dim=1).max()) if mask is not None else 0 for mask in masks]
        if max_tokens is not None:
            self.trained.check_token_budget(max_tokens)
            if any(mask is None for mask in masks):
                raise RlhfError(f"objective {self.config.objective!r} makes batches without an attention_mask; "
                                "--max-tokens-per-micro-batch needs one to count tokens")
        cuts = cut_by_length(lengths, size, max_tokens, packed=self.config.packing,
                             rows=[mask.shape[0] for mask in masks] if max_tokens is not None else None,
                             tokens=[int(mask.sum()) for mask in masks] if max_tokens is not None else None)
        return [_to_device(self.objective.collate([examples[i] for i in cut], pad), device) for cut in cuts]

    @staticmethod
    def _attention_mask(batch: dict[str, Any]) -> torch.Tensor | None:
        mask = batch.get("attention_mask")
        return mask if isinstance(mask, torch.Tensor) else None  # (rows, T)

    def _statistics(self, passes: Iterable[tuple[dict[str, Any], bool]],
                    compute: Callable[..., dict[str, float] | None]) -> dict[str, float]:
        """``compute(models, batch)`` summed over the counted ``(batch, counted)`` passes and the ranks,
        no grad, eval mode; empty when the objective has no such pass (its first answer is None).
        The step's statistics, the eval's and the final ones are all this."""
        sums: dict[str, float] | None = None
        self.trained.model.eval()
        with torch.no_grad():
            for batch, counted in passes:
                part = compute(self.models, batch)
                if part is None:
                    break
                if counted:
                    sums = {k: (sums or {}).get(k, 0.0) + float(v) for k, v in part.items()}
        return sum_over_ranks(sums, self.dist)

    def _passes(self, examples: list[Any]) -> Iterator[tuple[dict[str, Any], bool]]:
        """This rank's share of ``examples`` in micro-batches, as ``(batch, counted)``. Ranks may
        hold one example fewer; when the backend shards the weights (every forward is a collective)
        a rank short of micro-batches repeats one, uncounted, so all ranks run as many forwards."""
        mine = self.dist.shard(examples)
        micros = self._micro_batches(mine)
        rounds = len(micros)
        if self.trained.backend.shards_weights and self.dist.active:
            rounds = max(self.dist.all_gather(len(micros)))
        for index in range(rounds):
            if index < len(micros):
                yield micros[index], True
            else:
                yield self._micro_batches(examples[:1])[0], False

    def evaluate(self) -> dict[str, float]:
        """The objective's loss and metrics on the eval examples (no grad, eval mode): ``eval/*``
        (`rlhf.runtime.run.evaluation.objective_eval`)."""
        if not self.parts.eval_examples:
            return {}
        examples = self.objective.step_examples(list(self.parts.eval_examples))
        passes = list(self._passes(examples))
        stats = self._statistics(passes, self.objective.step_statistics)
        return objective_eval(self.objective, self.models, passes, stats, self.dist)

    def _eval_metric_names(self) -> set[str]:
        """The names the eval reports (``eval/loss`` and the objective's metrics), from one eval
        micro-batch (no grad, eval mode; every rank runs it, as forwards may be collectives)."""
        batch = self._micro_batches(self.objective.step_examples(list(self.parts.eval_examples[:1])))[0]
        stats = self._statistics([(batch, True)], self.objective.step_statistics)
        with torch.no_grad():
            _, metrics = self.objective.loss(self.models, batch, stats)
        self.trained.model.train()
        return {"eval/loss", *(f"eval/{k}" for k in metrics)}

    def final_statistics(self) -> dict[str, float]:
        """The objective's ``final_statistics`` over the training examples (no grad, eval mode)."""
        return self._statistics(self._passes(list(self.parts.train_examples)), self.objective.final_statistics)

    # --- eval schedule, best model, outputs ------------------------------------------------------

    def _eval_due(self, done: int) -> bool:
        """After every ``--eval-every`` steps (0: each epoch; -1: none in between) and the last."""
        every = self.config.eval_every or self.order.steps_per_epoch
        return bool(self.parts.eval_examples) and EvalSchedule(every, self.total_steps).due(done)

    def _export(self, directory: Path, record: dict[str, Any] | None = None, *, card: str | None = None) -> None:
        """The trained model to ``directory`` (written like a checkpoint: beside it, fsynced, renamed
        into place), with the objective's entries in its config.json (and ``record`` as best.json)."""
        extra = self.objective.output_config(self.final_statistics())
        self.run_dir.write_model(directory, lambda tmp: self.parts.export(tmp, extra),
                                 record={"best.json": record} if record is not None else None, card=card)

    # --- checkpoints ----------------------------------------------------------------------------

    def checkpoint_roles(self) -> dict[str, Any]:
        return {"model": self.trained}

    def trainer_state(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "world_size": self.dist.world_size, "best": self.best_model.record,
                "num_examples": self.order.num_examples}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("num_examples") != self.order.num_examples:
            raise RlhfError(f"--resume: the checkpoint was trained on {state.get('num_examples')} examples, this run "
                            f"has {self.order.num_examples}; resume with the same data and options")
        self.best_model.record = state.get("best")


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
