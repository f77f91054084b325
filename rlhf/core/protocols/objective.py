"""The objective contract (``register_objectives``): one offline training method, run by the fit loop.

SFT, reward models, DPO, KTO, PRM and distillation are each an objective; the fit loop
(``rlhf/runtime/fit/``) does everything else: data loading and order, models, micro-batches and
gradient accumulation, data parallelism, the training backend, eval, checkpoints and outputs
(docs/objectives.md). The runtime makes ``objective_cls(config)`` once per process (``config``: an
instance of the registered ``config_cls`` holding the user's ``--objective.*`` settings, or
None) and calls, in this order:

1. ``columns()``: the dataset columns every row must have (checked when the data loads: a missing
   column names the file and the columns present);
2. ``encode(row, text)`` once per dataset row: an *example* (any picklable object: token lists,
   labels). ``text`` is a `TextFormat`: the run's chat template / input template, tokenizer and
   ``--max-len``, the same formatting ``rlhf train`` gives prompts. Raise `SkipExample` to leave a
   row out (counted and reported once per reason) and `BadRow` for a row that cannot be used
   (the loop names its file and row);
3. per optimizer step: ``step_examples(examples)`` on the whole step (the same on every rank,
   before the step is split over ranks and micro-batches; the default returns them unchanged);
   then each micro-batch is ``collate(examples, pad_token_id)``, a dict of CPU tensors that the
   loop moves to the model's device;
4. ``step_statistics(models, batch)`` (optional, no grad): sums over one micro-batch, added up
   over the whole step (every micro-batch, every rank) and passed to ``loss`` as ``stats``;
   returning None (the default) skips the pass. KTO estimates its reference point this way;
5. ``loss(models, batch, stats) -> (loss, metrics)``: the **mean** loss over the micro-batch's
   ``units(batch)`` (tokens, pairs, samples: whatever the objective averages over) and metrics.
   The loop scales the mean by ``units / step units`` so an optimizer step's gradient is the
   mean over the whole step, whatever the micro-batch size or the number of ranks. A metric is
   a float (a mean over the micro-batch's units) or a ``(mean, weight)`` pair (a mean over
   another population, e.g. the desirable samples only); the loop reports weighted means.
   Eval runs the same ``loss`` under ``torch.no_grad()`` with the model in eval mode;
6. at the end: ``final_statistics(models, batch)`` over the training set (optional, like 4), then
   ``output_config(stats)``: entries merged into the saved model's ``config.json`` (a reward model
   records its EOS and normalisation conventions there).

Registration flags: ``needs_reference`` (a frozen copy of the starting model, or with LoRA the
adapter switched off, as ``models.reference``), ``needs_teacher`` (``--teacher``, as
``models.teacher``), ``head`` (``"lm"``: a causal LM; ``"score"``: a scalar head whose
``forward(input_ids, attention_mask)`` returns a value per position ``(B, T)``), ``default_lr``
(the learning rate when ``--lr`` is not given) and ``command`` (also offer ``rlhf <name>``, with
the objective's settings as plain flags). ``needs_reference`` and ``needs_teacher`` may be
functions of the config object.

The math of the built-in objectives is public: ``rlhf.objectives``. `ObjectiveBase` gives the
defaults of the optional methods.

Optional class attributes for ``rlhf plugins check``: ``sample_rows`` (dataset rows the check
encodes; default one short string per column) and ``sample_settings`` (settings it uses instead of
the defaults).

Shape legend: ``B`` sequences, ``T`` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlhf.core.errors import RlhfError

if TYPE_CHECKING:
    import torch

HEADS = ("lm", "score")


class SkipExample(Exception):
    """Raised by ``encode``: leave this row out. The message is the reason (rows are counted per reason)."""


class BadRow(RlhfError):
    """Raised by ``encode``: this row cannot be used. The loop prefixes the file and row number."""


def require(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]``, or `BadRow` naming the columns present when it is missing or empty."""
    value = row.get(key)
    if value is None or value == "" or value == []:
        present = ", ".join(k for k in row if not k.startswith("__rlhf_"))
        raise BadRow(f"empty or missing {key!r} (columns: {present})")
    return value


@dataclass
class FitModels:
    """The models an objective's loss may use, on one device.

    ``model`` is the trained model as training forwards must call it (the backend's train module:
    its forward is what the backend's backward follows); ``reference`` and ``teacher`` are frozen
    and present only when the objective declares it needs them. ``share_prompt``: the run allows
    sequences that begin alike to share their prefix's forward (``--share-prompt``,
    `rlhf.fastpaths.prefix_sharing`).
    """

    model: torch.nn.Module
    reference: torch.nn.Module | None = None
    teacher: torch.nn.Module | None = None
    share_prompt: bool = False


@runtime_checkable
class TextFormat(Protocol):
    """How rows become tokens: the run's templates, tokenizer and length budget."""

    tokenizer: Any
    eos_token_id: int
    max_len: int

    def prompt(self, value: Any) -> str:
        """A prompt (a string, or chat messages) as text: the chat template with the generation
        prompt under ``--apply-chat-template``, else ``--input-template`` (if any) around the string."""

    def response(self, prompt: Any, value: Any) -> str:
        """The text of a response (a string, or messages) that follows ``prompt``: under the chat
        template, the template of prompt + response minus that of the prompt."""

    def conversation(self, messages: Any) -> tuple[str, str]:
        """A whole conversation as (prompt text: every message but the last, with the generation
        prompt; response text: the last message). Needs ``--apply-chat-template``."""

    def chat(self, messages: Any, *, generation_prompt: bool = False) -> str:
        """The chat template applied to messages (with the generation prompt when asked). Needs
        ``--apply-chat-template``."""

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of a prompt text, exactly as ``rlhf train`` tokenizes its prompts."""

    def ids(self, text: str) -> list[int]:
        """Token ids of a text, no special tokens added."""

    def join(self, prompt_ids: list[int], response_ids: list[int], *, eos: bool = True) -> tuple[list[int], int]:
        """``(ids, prompt_len)``: prompt + response (+ EOS) within ``max_len``; an overlong response
        loses its end (EOS stays last). Raises `SkipExample` when the prompt leaves no room."""


@runtime_checkable
class Objective(Protocol):
    def columns(self) -> list[str]:
        """Dataset columns every row must have."""

    def encode(self, row: Mapping[str, Any], text: TextFormat) -> Any:
        """One dataset row -> one example. Raise `SkipExample` or `BadRow`."""

    def step_examples(self, examples: list[Any]) -> list[Any]:
        """The examples of one optimizer step, before they are split over ranks and micro-batches."""

    def collate(self, examples: list[Any], pad_token_id: int) -> dict[str, Any]:
        """Examples -> one micro-batch: a dict of CPU tensors (right padding)."""

    def units(self, batch: dict[str, Any]) -> float:
        """What ``loss`` averages over in this micro-batch (tokens, pairs, samples)."""

    def step_statistics(self, models: FitModels, batch: dict[str, Any]) -> dict[str, float] | None:
        """Sums over a micro-batch, added up over the step and passed to ``loss``; None: no such pass."""

    def loss(self, models: FitModels, batch: dict[str, Any],
             stats: Mapping[str, float]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The mean loss over the micro-batch's units, and metrics."""

    def final_statistics(self, models: FitModels, batch: dict[str, Any]) -> dict[str, float] | None:
        """Sums over the training set after training (for ``output_config``); None: no such pass."""

    def output_config(self, stats: Mapping[str, float]) -> dict[str, Any]:
        """Entries to merge into the saved model's ``config.json``."""


class ObjectiveBase:
    """Defaults of the optional parts of `Objective`: nothing at step or run level, one unit per row."""

    config: Any = None

    def __init__(self, config: Any = None):
        self.config = config

    def step_examples(self, examples: list[Any]) -> list[Any]:
        return examples

    def units(self, batch: dict[str, Any]) -> float:
        return float(len(batch["input_ids"]))

    def step_statistics(self, models: FitModels, batch: dict[str, Any]) -> dict[str, float] | None:
        return None

    def final_statistics(self, models: FitModels, batch: dict[str, Any]) -> dict[str, float] | None:
        return None

    def output_config(self, stats: Mapping[str, float]) -> dict[str, Any]:
        return {}
