"""The agent rollout (``--agent``): each of the n samples of a prompt is one agent call against an
endpoint of its own; what the policy sampled through it becomes the trajectory (docs/agents.md).

A trajectory is the recorded sequences that hold model tokens (a chain of requests extending each
other is one sequence; `rlhf.runtime.agents.recording`): the last one is the trajectory's own row,
so a prompt group keeps its n rows for the advantage; when the agent branched (edited or
summarised its history) the earlier ones are its ``segments``, each trained as a row of its own with
the trajectory's reward and advantage (`rlhf.runtime.step.segments`).

A call that raises, times out, returns NaN, or returns no reward when the run has no ``--reward``
is a failed trajectory: ``outcome`` ``agent_error`` or ``timeout``, ``error`` its first line, and a
loss mask of 0 everywhere, so nothing trains on it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from rlhf.core.types import Trajectory
from rlhf.runtime.agents.calling import AgentCaller, Called
from rlhf.runtime.agents.endpoint import AgentEndpoint
from rlhf.runtime.agents.recording import Sequence, TrajectoryRecord


@dataclass(frozen=True)
class AgentSettings:
    name: str  # what --agent named
    input_key: str  # the dataset column the prompt came from
    has_reward_sources: bool  # the run has --reward: an agent may return None


class AgentRollout:
    """Runs the agent once per trajectory and turns its records into trajectories."""

    def __init__(self, endpoint: AgentEndpoint, caller: AgentCaller, tokenizer: Any, settings: AgentSettings):
        self.endpoint, self.caller, self.tokenizer, self.settings = endpoint, caller, tokenizer, settings

    async def run(self, prompts: list[Any], n: int, rollout_seed: int, *, logprobs: bool,
                  policy_version: int | None = None) -> list[Trajectory]:
        """``policy_version``: the steps the engine's weights have taken, recorded with every sampled token."""
        jobs = [(group, item) for group, item in enumerate(prompts) for _ in range(n)]
        return list(await asyncio.gather(*(self._one(group, item, index, rollout_seed, logprobs, policy_version)
                                           for index, (group, item) in enumerate(jobs))))

    async def _one(self, group: int, item: Any, index: int, rollout_seed: int, logprobs: bool,
                   policy_version: int | None) -> Trajectory:
        trajectory_id, endpoint, record = self.endpoint.open(index, rollout_seed, policy_version)
        sample = {self.settings.input_key: item.prompt, **item.columns}
        try:
            called = await self.caller(sample, endpoint)
        finally:
            errors = self.endpoint.close(trajectory_id)
        if called.result is not None and called.result.reward is None and not self.settings.has_reward_sources:
            called = Called(None, "agent_error", f"the agent {self.settings.name!r} returned no reward and the run "
                                                 "has no --reward to score it")
        return self._trajectory(group, item, record, called, errors, logprobs)

    def _trajectory(self, group: int, item: Any, record: TrajectoryRecord, called: Called, errors: list[str],
                    logprobs: bool) -> Trajectory:
        sequences = record.trained_sequences()
        ok = called.outcome == "ok"
        main = sequences[-1] if sequences else None
        if main is None:  # nothing sampled: the prompt and an EOS, nothing to train
            eos = self.tokenizer.eos_token_id
            main = Sequence()
            main.extend(list(item.prompt_ids) + ([eos] if eos is not None else []), model=False,
                        origins=["prompt"] * (len(item.prompt_ids) + (eos is not None)))
        result = called.result
        info = {
            "agent": self.settings.name, "env": f"agent:{self.settings.name}",
            "env_reward": float(result.reward) if result is not None and result.reward is not None else 0.0,
            "env_gives_rewards": result is not None and result.reward is not None,
            "agent_requests": record.requests, "agent_follow_ups": record.follow_ups, "agent_drift": record.drift,
            "agent_segments": len(sequences),
            **({"agent_parse_failures": list(record.parse_failures)} if record.parse_failures else {}),
            **({"agent_request_errors": errors} if errors else {}),
            **({"agent_info": dict(result.info)} if result is not None and result.info else {}),
        }
        trajectory = self._row(main, group, item, ok, logprobs, info)
        trajectory.outcome, trajectory.error = called.outcome, called.error
        trajectory.segments = [self._row(sequence, group, item, ok, logprobs, {}) for sequence in sequences[:-1]]
        return trajectory

    def _row(self, sequence: Sequence, group: int, item: Any, ok: bool, logprobs: bool,
             info: dict[str, Any]) -> Trajectory:
        """One recorded sequence as a trajectory's row: its model tokens train unless the call failed."""
        mask = list(sequence.mask) if ok else [0] * len(sequence.tokens)
        prompt_length = next((i for i, m in enumerate(sequence.mask) if m), len(sequence.tokens) - 1)
        return Trajectory(
            token_ids=list(sequence.tokens), loss_mask=mask, prompt_length=prompt_length, prompt=item.prompt,
            prompt_text=self.tokenizer.decode(sequence.tokens[:prompt_length], skip_special_tokens=False),
            completion_text=self.tokenizer.decode(sequence.tokens[prompt_length:], skip_special_tokens=True),
            group=group, label=item.label, columns=dict(item.columns),
            rollout_logprobs=(list(sequence.logprobs) if ok else [0.0] * len(sequence.tokens)) if logprobs else None,
            finish_reason="length" if sequence.finish_reason == "length" else "stop",
            num_turns=len(sequence.checkpoints),
            token_versions=[-1 if version is None else version for version in sequence.versions],
            info={**info, "agent_token_origins": runs(sequence.origins)})


def runs(labels: list[str]) -> list[list]:
    """Labels as ``[label, count]`` runs: ``["template", 4], ["user", 7], ["template", 3], ["model", 9]``."""
    out: list[list] = []
    for label in labels:
        if out and out[-1][0] == label:
            out[-1][1] += 1
        else:
            out.append([label, 1])
    return out
