"""What a rollout engine receives and returns (the ``register_rollout_engines`` contract)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
