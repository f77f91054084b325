"""The rollout-engine contract (``register_rollout_engines``): what an engine receives and returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """How to sample one turn. Log-probs used for training are computed at the same temperature."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings (multi-turn environments); EOS always stops
    return_logprobs: bool = False  # report the log-prob of each sampled token


@dataclass(kw_only=True)
class Generation:
    """One completion of one prompt."""

    token_ids: list[int]  # generated tokens, EOS included when generated, no padding
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    logprobs: list[float] | None = None  # per generated token, when asked for
    stop_string: str | None = None  # the stop string that ended generation, if any
    extra: dict = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    """The rollout-engine contract (``register_rollout_engines``).

    The runtime creates ``engine_cls(model, tokenizer, config)`` with the policy module, then calls
    ``generate`` for every turn of every rollout. ``shares_weights``: the engine samples from that
    module in place (nothing to sync). Otherwise the runtime calls ``load_weights()`` after each
    optimizer step (and after a resume): the engine takes the weights from the policy module it
    was built with (LoRA merged, sharded weights gathered: the engine's business).
    """

    shares_weights: bool

    def generate(self, prompts: list[list[int]], *, n: int, params: SamplingParams) -> list[Generation]:
        """``n`` completions per prompt (token-id lists), contiguous: ``[p0s0 .. p0s(n-1), p1s0, ...]``."""

    def load_weights(self, state: Mapping[str, Any] | None = None) -> None:
        """Sample from new weights from now on: the policy module's (``state`` None, what the runtime
        passes) or those of ``state`` (full weights under the policy's parameter names)."""
