"""Options shared by every reward source. Field names become ``rlhf train --reward-<field>`` flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from rlhf.rewards.failures import RewardConfigError

OnError = Literal["raise", "zero", "skip", "fail"]
ON_ERROR_CHOICES: tuple[str, ...] = ("raise", "zero", "skip", "fail")
DEFAULT_TOKEN_ENV = "RLHF_REWARD_TOKEN"


@dataclass(kw_only=True)
class RewardOptions:
    """How reward sources run, time out, retry and fail."""

    on_error: OnError = field(default="raise", metadata={"help": (
        "What a failed sample (exception, timeout, wrong length, non-finite value) gets: 'raise' stops the run "
        "naming the function and the sample; 'fail' ends it with the outcome reward_error, which --on-failure "
        "handles; 'skip' is 'fail' with --on-failure mask (the sample leaves the loss and its group's baseline); "
        "'zero' scores it 0 and trains on it (biases its group's baseline: only when you mean it)")})
    timeout_s: float = field(default=180.0, metadata={"help": (
        "Seconds before one HTTP request, or one call of an async or threaded reward function, is abandoned")})
    retries: int = field(default=3, metadata={"help": "HTTP retries after the first attempt (exponential backoff)"})
    backoff_s: float = field(default=1.0, metadata={"help": "First HTTP retry delay in seconds; doubles each retry"})
    backoff_max_s: float = field(default=30.0, metadata={"help": "Longest delay between HTTP retries, in seconds"})
    http_batch_size: int = field(default=32, metadata={"help": "Samples per HTTP request"})
    concurrency: int = field(default=8, metadata={"help": "HTTP requests in flight at once, per source"})
    token_env: str | None = field(default=None, metadata={"help": (
        f"Environment variable holding a bearer token sent to reward servers (default: {DEFAULT_TOKEN_ENV} "
        "when it is set)")})
    async_concurrency: int = field(default=64, metadata={"help": (
        "Calls of a per-sample async (or threaded) reward function running at once")})
    sync_in_thread: bool = field(default=False, metadata={"help": (
        "Run sync reward functions in worker threads, where --reward-timeout-s applies. Off by default: they "
        "run in the calling thread like TRL and verl do, which signal-based verifiers (math_verify) need")})
    value_head_prefix: str = field(default="score", metadata={"help": (
        "Attribute holding the linear score head of a base-model reward checkpoint (OpenRLHF layout); "
        "`value_head_prefix` in the checkpoint's config.json wins")})
    rm_batch_size: int = field(default=8, metadata={"help": "Sequences per reward-model forward pass"})
    rm_dtype: str = field(default="auto", metadata={"help": (
        "Reward-model dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16")})
    rm_device: str | None = field(default=None, metadata={"help": "Reward-model device (default: cuda when available)"})
    rm_max_length: int | None = field(default=None, metadata={"help": (
        "Truncate reward-model inputs to this many tokens, keeping the end (where the score is read)")})
    rm_append_eos: bool = field(default=False, metadata={"help": (
        "Append the reward model's EOS token to each text (OpenRLHF reward models are trained with it last; "
        "on without this flag when the model's config.json says reward_append_eos, as `rlhf rm` writes)")})
    rm_normalize: bool = field(default=False, metadata={"help": (
        "Apply (r - mean) / std with the mean and std stored in the reward model's config.json (OpenRLHF; on "
        "without this flag when config.json says normalize_reward)")})

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR_CHOICES:
            choices = ", ".join(ON_ERROR_CHOICES)
            raise RewardConfigError(f"reward on_error must be one of {choices}, got {self.on_error!r}")
        positive = ("timeout_s", "http_batch_size", "concurrency", "async_concurrency", "rm_batch_size")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise RewardConfigError(f"reward option {name} must be a positive number, got {value!r}")
        for name in ("retries", "backoff_s", "backoff_max_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise RewardConfigError(f"reward option {name} must be >= 0, got {value!r}")

    @classmethod
    def from_kwargs(cls, **options: Any) -> RewardOptions:
        """Build from keyword arguments; an unknown name is an error listing the valid ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise RewardConfigError(f"unknown reward option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        return cls(**options)
