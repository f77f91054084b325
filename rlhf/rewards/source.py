"""The reward-source contract: a batch goes in, one score (or ``None``) per sample comes out.

`RewardBatch` is what every source sees (built from trajectories by the runtime, or from lists by
``score``). `SourceOutput` is what it returns before the failure policy: values, failures per
sample, and optional OpenRLHF ``scores`` / ``extra_logs``. `RewardSource` is the base class of the
function, HTTP and reward-model sources.

Threading: the sync API (``score``) runs *inline* sources (sync functions, reward models) in the
calling thread, and the others (HTTP, async functions) on an event loop in a background thread;
the async API (``ascore``) runs everything on the caller's loop, inline sources in worker threads.
Several threads may score at once (a pipelined ``--async`` run scores the batches of several
steps together): the sync API still calls an inline source from one thread at a time, and each
source's concurrency option bounds its calls in flight over every batch (`CallLimit`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhf.rewards.failures import RewardConfigError, RewardFailure, apply_policy, excerpt
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.threads import run_in_thread, start_in_background

if TYPE_CHECKING:
    from rlhf.core.types import Trajectory


@dataclass
class RewardBatch:
    """The samples a source scores, as parallel lists of length B."""

    prompts: list[Any]  # as the dataset gave them: a string or a chat message list
    completions: list[str]  # decoded completions
    labels: list[Any]
    prompt_texts: list[str]  # prompts as the model saw them (after the chat template)
    completion_ids: list[list[int]] | None = None
    columns: dict[str, list[Any]] = field(default_factory=dict)  # every other dataset column, by name

    def __post_init__(self) -> None:
        n = len(self.completions)
        lengths = {"prompts": len(self.prompts), "labels": len(self.labels), "prompt_texts": len(self.prompt_texts)}
        lengths.update({f"column {k!r}": len(v) for k, v in self.columns.items()})
        if self.completion_ids is not None:
            lengths["completion_ids"] = len(self.completion_ids)
        wrong = ", ".join(f"{v} {k}" for k, v in lengths.items() if v != n)
        if wrong:
            raise RewardConfigError(f"rewards need one value per sample: {n} completions but {wrong}")
        bad = [type(c).__name__ for c in self.completions if not isinstance(c, str)]
        if bad:
            raise RewardConfigError(f"completions must be strings (decoded text), got {bad[0]}")

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def queries(self) -> list[str]:
        """Prompt text + completion: what OpenRLHF calls a query."""
        return [p + c for p, c in zip(self.prompt_texts, self.completions)]

    @classmethod
    def from_lists(cls, prompts: Sequence[Any], completions: Sequence[str], labels: Sequence[Any] | None = None,
                   *, prompt_texts: Sequence[str] | None = None, completion_ids: Sequence[list[int]] | None = None,
                   **columns: Sequence[Any]) -> RewardBatch:
        n = len(completions)
        return cls(prompts=list(prompts), completions=list(completions),
                   labels=list(labels) if labels is not None else [None] * n,
                   prompt_texts=list(prompt_texts) if prompt_texts is not None else [render_prompt(p) for p in prompts],
                   completion_ids=[list(ids) for ids in completion_ids] if completion_ids is not None else None,
                   columns={k: list(v) for k, v in columns.items()})

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory]) -> RewardBatch:
        names: dict[str, None] = {}
        for t in trajectories:
            names.update(dict.fromkeys(t.columns))
        return cls(prompts=[t.prompt for t in trajectories], completions=[t.completion_text for t in trajectories],
                   labels=[t.label for t in trajectories], prompt_texts=[t.prompt_text for t in trajectories],
                   completion_ids=[list(t.completion_ids) for t in trajectories],
                   columns={k: [t.columns.get(k) for t in trajectories] for k in names})

    def select(self, indices: Sequence[int]) -> RewardBatch:
        pick = lambda xs: [xs[i] for i in indices]  # noqa: E731
        return RewardBatch(prompts=pick(self.prompts), completions=pick(self.completions), labels=pick(self.labels),
                           prompt_texts=pick(self.prompt_texts),
                           completion_ids=pick(self.completion_ids) if self.completion_ids is not None else None,
                           columns={k: pick(v) for k, v in self.columns.items()})

    def row(self, index: int) -> dict[str, Any]:
        return {k: v[index] for k, v in self.columns.items()}


def render_prompt(prompt: Any) -> str:
    """A prompt's text when no chat template was applied: the string, or the messages' contents joined."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return "\n".join(str(m.get("content", "")) for m in prompt)
    return str(prompt)


@dataclass
class SourceOutput:
    """One source's result on a batch, before the failure policy."""

    values: list[float | None]  # None: no score (the function said so) or failed
    failures: dict[int, RewardFailure] = field(default_factory=dict)
    scores: list[float | None] | None = None  # OpenRLHF's optional 0-1 scores (dynamic filtering)
    extra_logs: dict[str, list[float]] = field(default_factory=dict)  # values to average into metrics



class RewardSource:
    """Base class: subclasses implement ``_score_inline`` (when ``inline``) and/or ``_ascore``."""

    kind = "source"

    def __init__(self, name: str, where: str, options: RewardOptions | None = None):
        self.name = name
        self.where = where
        self.options = options or RewardOptions()
        self._reported: set[str] = set()  # sources whose first failure was logged
        # the sync API calls an inline source from one thread at a time, however many batches are
        # scored at once (a pipelined --async run): a plain function need not be thread-safe
        self._inline_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ({self.where})>"

    @property
    def inline(self) -> bool:
        """True when the sync API runs this source in the calling thread."""
        return False

    @property
    def label_inputs(self) -> list[str]:
        """The label inputs this source cannot score without (a function's required ``labels``,
        ``label`` or ``ground_truth`` argument); empty when it needs none or cannot say."""
        return []

    # --- to implement -------------------------------------------------------------------------

    def offload_between_uses(self) -> None:
        """Keep this source's model off the device except while it scores (``--offload-ref-reward``);
        sources without a model of their own in this process have nothing to move."""

    def _score_inline(self, batch: RewardBatch) -> SourceOutput:
        """Score ``batch`` in the calling thread. Sources that score in the event loop override
        `_ascore` instead and never reach this."""
        raise NotImplementedError(f"{type(self).__name__} overrides neither _score_inline nor _ascore")

    async def _ascore(self, batch: RewardBatch) -> SourceOutput:
        """Default for inline sources: the whole batch in a worker thread, so the loop never blocks."""
        return await run_in_thread(self._score_inline, batch)

    # --- raw results (failures recorded, no policy) ----------------------------------------

    def score_batch(self, batch: RewardBatch) -> SourceOutput:
        if self.inline:
            with self._inline_lock:
                return self._check(self._score_inline(batch), batch)
        return start_in_background(lambda: self.ascore_batch(batch)).result()

    async def ascore_batch(self, batch: RewardBatch) -> SourceOutput:
        return self._check(await self._ascore(batch), batch)

    def _check(self, output: SourceOutput, batch: RewardBatch) -> SourceOutput:
        assert len(output.values) == len(batch), f"{self!r} returned {len(output.values)} values for {len(batch)}"
        return output

    def failure(self, batch: RewardBatch, index: int, reason: str, message: str, tb: str = "") -> RewardFailure:
        return RewardFailure(source=self.name, where=self.where, index=index, reason=reason, message=message,
                             prompt=excerpt(batch.prompt_texts[index]), traceback=tb)

    def fail_all(self, batch: RewardBatch, reason: str, message: str, tb: str = "") -> SourceOutput:
        """Every sample of the batch failed the same way (a batched call raised or returned junk)."""
        return SourceOutput(values=[None] * len(batch),
                            failures={i: self.failure(batch, i, reason, message, tb) for i in range(len(batch))})

    # --- public API: one score per sample, policy applied --------------------------------------

    def score(self, prompts: Sequence[Any], completions: Sequence[str], labels: Sequence[Any] | None = None,
              **columns: Any) -> list[float | None]:
        """Score a batch; failures follow ``options.on_error`` (``skip`` and "no score" give ``None``).

        Keyword arguments ``prompt_texts`` and ``completion_ids`` are optional inputs; any other
        keyword is a dataset column (one value per sample).
        """
        batch = RewardBatch.from_lists(prompts, completions, labels, **columns)
        return self._policy(self.score_batch(batch))

    async def ascore(self, prompts: Sequence[Any], completions: Sequence[str], labels: Sequence[Any] | None = None,
                     **columns: Any) -> list[float | None]:
        """The async twin of `score`."""
        batch = RewardBatch.from_lists(prompts, completions, labels, **columns)
        return self._policy(await self.ascore_batch(batch))

    def _policy(self, output: SourceOutput) -> list[float | None]:
        values, _ = apply_policy(output.values, output.failures, self.options.on_error, self._reported)
        return values
