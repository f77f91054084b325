"""The metrics of one training step (``metrics.jsonl``, the progress bar, loggers): rewards as the
loss used them, lengths, KL, environment figures for multi-turn runs, the roles' training
metrics, time per phase (`Timer`) and throughput."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from rlhf.core.batch import ExperienceBatch
from rlhf.core.types import Trajectory


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


def step_metrics(trajectories: list[Trajectory], batch: ExperienceBatch, reward_metrics: dict[str, float],
                 train: dict[str, float], timings: dict[str, float]) -> dict[str, float]:
    own = len(trajectories)  # the trajectories' own rows; segment rows follow (rlhf.runtime.step.segments)
    mask = batch.sample_mask[:own].bool()
    scored = batch.rewards[:own][mask]
    lengths = torch.tensor([t.num_policy_tokens for t in trajectories], dtype=torch.float32)
    metrics: dict[str, float] = dict(reward_metrics)  # per source; the totals below are what the loss used
    metrics.update({
        "reward/mean": float(scored.mean()) if scored.numel() else float("nan"),
        "reward/std": float(scored.std()) if scored.numel() > 1 else 0.0,
        "reward/skipped": float((~mask).sum()),
        "response/length_mean": float(lengths.mean()),
        "response/truncated_rate": sum(t.finish_reason == "length" for t in trajectories) / len(trajectories),
    })
    if batch.kl is not None:
        metrics["kl/mean"] = float(batch.kl.sum() / batch.action_mask.sum().clamp(min=1))
    elif "policy/kl" in train:
        metrics["kl/mean"] = train["policy/kl"]
    if batch.teacher_logprobs is not None and batch.old_logprobs is not None:  # on-policy distillation
        mask = batch.loss_mask
        gap = (batch.old_logprobs - batch.teacher_logprobs) * mask  # (B, A)
        metrics["teacher/reverse_kl"] = float(gap.sum() / mask.sum().clamp(min=1))  # per token, student's samples
    if any(t.num_turns > 1 or t.info.get("multi_turn") for t in trajectories):
        metrics.update(_env_metrics(trajectories))
    if any("agent" in t.info for t in trajectories):
        metrics.update(agent_metrics(trajectories))
        metrics["agent/segment_rows"] = float(batch.size - own)  # the segments' rows the step trained on
    metrics.update(train)
    metrics.update({f"time/{k}": v for k, v in timings.items()})
    metrics["throughput/tokens_per_s"] = float(lengths.sum()) / max(timings["step"], 1e-9)
    return metrics


def _env_metrics(trajectories: list[Trajectory]) -> dict[str, Any]:
    count = len(trajectories)
    return {
        "env/reward_mean": sum(t.info.get("env_reward", 0.0) for t in trajectories) / count,
        "env/turns_mean": sum(t.num_turns for t in trajectories) / count,
        "env/time_s": sum(t.info.get("env_time_s", 0.0) for t in trajectories),
        "env/budget_rate": sum(t.finish_reason == "budget" for t in trajectories) / count,
        "env/env_tokens_mean": sum(len(t.token_ids) - t.prompt_length - t.num_policy_tokens
                                   for t in trajectories) / count,
    }


def agent_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """``--agent`` (docs/agents.md): ``drift_rate``, the share of follow-up requests the chat template
    rendered otherwise than the recorded tokens (spliced, or a new segment); ``segments_mean``,
    sequences per trajectory; ``failure_rate``, calls that raised or timed out; the share of
    completions whose tool calls could not be parsed; requests per call."""
    count = len(trajectories)
    follow_ups = sum(t.info.get("agent_follow_ups", 0) for t in trajectories)
    requests = sum(t.info.get("agent_requests", 0) for t in trajectories)
    return {
        "agent/drift_rate": sum(t.info.get("agent_drift", 0) for t in trajectories) / max(follow_ups, 1),
        "agent/segments_mean": sum(t.info.get("agent_segments", 0) for t in trajectories) / count,
        "agent/failure_rate": sum(t.outcome in ("agent_error", "timeout") for t in trajectories) / count,
        "agent/parse_failure_rate": sum(len(t.info.get("agent_parse_failures", ())) for t in trajectories)
        / max(requests, 1),
        "agent/requests_mean": requests / count,
    }


def sequence_kl(batch: ExperienceBatch, metrics: dict[str, float]) -> float:
    """The step's KL to the reference for the adaptive controller: the mean over samples of each
    sample's token-mean KL (OpenRLHF's), or the training loss's KL when no KL was computed before."""
    if batch.kl is not None:
        mask = batch.loss_mask  # (B, A)
        per_sample = (batch.kl * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
        counted = mask.sum(dim=1) > 0  # (B,)
        return float(per_sample[counted].mean()) if counted.any() else 0.0
    return float(metrics.get("policy/kl", 0.0))


def _is_count(key: str) -> bool:
    return key.endswith(("failures", "skipped", "/count")) or "/failures/" in key


def merge_round_metrics(rounds: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Reward metrics of several sampling rounds (dynamic filtering): counts summed, means weighted
    by each round's samples."""
    if len(rounds) == 1:
        return dict(rounds[0][0])
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, size in rounds:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + (value if _is_count(key) else value * size)
            weights[key] = weights.get(key, 0.0) + size
    return {key: total if _is_count(key) else total / weights[key] for key, total in sums.items()}
