"""Several reward sources as one: the weighted sum, per-source metrics and the failure policy.

For sample i with weights w_s: ``total_i = sum_s w_s * r_s,i`` over the sources that scored it
(a source returning ``None`` for a sample abstains, as in TRL; a source of weight 0 is only logged).
``total_i`` is ``None`` (drop the sample from the loss) when no source scored it or when a source
failed on it under ``fail`` or ``skip``.

Metrics per call: ``reward/<name>`` (mean over the samples the source scored, after the policy),
``reward/failures/<name>`` (failed samples), ``reward/<name>/<key>`` (means of OpenRLHF
``extra_logs`` and verl dict keys), ``reward/<name>/score`` (mean OpenRLHF ``scores``),
``reward/mean`` (mean total), ``reward/skipped`` (samples whose total is ``None``) and
``reward/failures`` (all failed samples).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlhf.core.rewards import RewardFailure, RewardResult
from rlhf.rewards.failures import apply_policy
from rlhf.rewards.options import ON_ERROR_CHOICES
from rlhf.rewards.source import RewardBatch, RewardSource, SourceOutput
from rlhf.rewards.threads import start_in_background

if TYPE_CHECKING:
    from rlhf.core.types import Trajectory

RESERVED_NAMES = ("mean", "failures", "skipped")  # metric keys of the set itself


def _mean(values: Sequence[float | None]) -> float | None:
    used = [v for v in values if v is not None]
    return sum(used) / len(used) if used else None


class RewardSet:
    """Reward sources with weights and one failure policy; what ``rlhf train`` calls every step."""

    def __init__(self, sources: Sequence[RewardSource], weights: Sequence[float] | None = None,
                 on_error: str = "raise"):
        self.sources = list(sources)
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(self.sources)
        assert self.sources, "a reward set needs at least one source"
        assert len(self.weights) == len(self.sources), f"{len(self.sources)} sources, {len(self.weights)} weights"
        names = [s.name for s in self.sources]
        assert len(set(names)) == len(names), f"reward source names must be unique, got {names}"
        assert on_error in ON_ERROR_CHOICES, f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}"
        self.on_error = on_error
        self._reported: set[str] = set()

    def offload_between_uses(self) -> None:
        """``--offload-ref-reward``: every source with a model keeps it off the device between scores."""
        for source in self.sources:
            source.offload_between_uses()

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def check_labels_given(self, label_key: str | None, *, flag: str = "--label-key") -> None:
        """Refuse a run whose data gives no labels (``label_key`` None) while a source needs them:
        every sample would reach it with label None and score nothing, silently."""
        if label_key:
            return
        for source in self.sources:
            if source.label_inputs:
                from rlhf.rewards.failures import RewardConfigError

                raise RewardConfigError(
                    f"reward {source.name!r} compares completions with labels (its {source.label_inputs[0]!r} "
                    f"argument) and the data gives none: pass {flag} COLUMN, the data's answer column")

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": s.name, "weight": w, "kind": s.kind, "where": s.where}
                for s, w in zip(self.sources, self.weights)]

    # --- scoring ------------------------------------------------------------------------------

    def score_trajectories(self, trajectories: Sequence[Trajectory]) -> RewardResult:
        return self.score_batch(RewardBatch.from_trajectories(trajectories))

    async def ascore_trajectories(self, trajectories: Sequence[Trajectory]) -> RewardResult:
        return await self.ascore_batch(RewardBatch.from_trajectories(trajectories))

    def score(self, prompts: Sequence[Any], completions: Sequence[str], labels: Sequence[Any] | None = None,
              **columns: Any) -> RewardResult:
        """Score lists (``prompt_texts=``, ``completion_ids=`` and dataset columns as keywords)."""
        return self.score_batch(RewardBatch.from_lists(prompts, completions, labels, **columns))

    async def ascore(self, prompts: Sequence[Any], completions: Sequence[str], labels: Sequence[Any] | None = None,
                     **columns: Any) -> RewardResult:
        return await self.ascore_batch(RewardBatch.from_lists(prompts, completions, labels, **columns))

    def score_batch(self, batch: RewardBatch) -> RewardResult:
        """Inline sources run in this thread while the others run on a background event loop."""
        background = [s for s in self.sources if not s.inline]
        future = start_in_background(lambda: self._gather(background, batch)) if background else None
        outputs = {s.name: s.score_batch(batch) for s in self.sources if s.inline}
        if future is not None:
            outputs.update(future.result())
        return self.combine(batch, outputs)

    async def ascore_batch(self, batch: RewardBatch) -> RewardResult:
        return self.combine(batch, await self._gather(self.sources, batch))

    async def _gather(self, sources: list[RewardSource], batch: RewardBatch) -> dict[str, SourceOutput]:
        results = await asyncio.gather(*(s.ascore_batch(batch) for s in sources))
        return {s.name: r for s, r in zip(sources, results)}

    # --- combination --------------------------------------------------------------------------

    def combine(self, batch: RewardBatch, outputs: dict[str, SourceOutput]) -> RewardResult:
        n = len(batch)
        per_source: dict[str, list[float | None]] = {}
        scores: dict[str, list[float | None]] = {}
        metrics: dict[str, float] = {}
        dropped: set[int] = set()
        first: RewardFailure | None = None
        errors: dict[int, str] = {}
        for source in self.sources:
            name, output = source.name, outputs[source.name]
            if output.failures and first is None:
                first = output.failures[min(output.failures)]
            for index, failure in sorted(output.failures.items()):
                errors.setdefault(index, f"reward {failure.source!r} failed ({failure.reason}): {failure.message}")
            values, drop = apply_policy(output.values, output.failures, self.on_error, self._reported)
            dropped |= drop
            per_source[name] = values
            metrics[f"reward/failures/{name}"] = float(len(output.failures))
            if (mean := _mean(values)) is not None:
                metrics[f"reward/{name}"] = mean
            for key, logged in output.extra_logs.items():
                metrics[f"reward/{name}/{key}"] = sum(logged) / len(logged)
            if output.scores is not None:
                scores[name] = output.scores
                if (mean := _mean(output.scores)) is not None:
                    metrics[f"reward/{name}/score"] = mean
        total: list[float | None] = []
        for i in range(n):
            parts = [w * per_source[s.name][i] for s, w in zip(self.sources, self.weights)
                     if w != 0 and per_source[s.name][i] is not None]  # weight 0: logged, never used
            total.append(None if i in dropped or not parts else sum(parts))
        if (mean := _mean(total)) is not None:
            metrics["reward/mean"] = mean
        metrics["reward/skipped"] = float(sum(t is None for t in total))
        metrics["reward/failures"] = float(sum(len(o.failures) for o in outputs.values()))
        combined: list[float | None] = []
        if scores:
            for i in range(n):
                values = [(w, scores[s.name][i] if s.name in scores and scores[s.name][i] is not None
                           else per_source[s.name][i]) for s, w in zip(self.sources, self.weights) if w != 0]
                parts = [w * v for w, v in values if v is not None]  # a source may abstain (None)
                combined.append(None if total[i] is None or not parts else sum(parts))
        return RewardResult(total=total, per_source=per_source, metrics=metrics, scores=scores, first_error=first,
                            combined_scores=combined, errors=dict(sorted(errors.items())))
