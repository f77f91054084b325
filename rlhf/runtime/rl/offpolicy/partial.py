"""Partial rollouts (``--async --partial-rollouts``): a trajectory moves to newer weights mid-generation.

`PartialRollout` is what a rollout of batch s gets from the producer: the version of each of its
policy tokens (`rlhf.runtime.rl.offpolicy.schedule.VersionSchedule`, a logical clock of tokens) and
the engine that holds a version. The rollout sends each turn to the engine of its first token's
version for as many tokens as that version lasts; the rest of the turn goes, as a request of its
own, to the next version's engine, once that version is published (the producer waits for it: the
trainer publishes version v when step v is done). The next request re-reads the whole trajectory
(prompt and the tokens so far): the KV cache is *recomputed* with the new weights, so every token
after the switch is sampled exactly as the new policy would, from its own attention state. Each
request after the first samples from a random stream of its own (the turn's seed hashed with the
token index), so what a trajectory samples depends on the clock only, not on timing.

`VersionPool` holds the policy copies of the versions newer than a batch's first one (the first
is its lane's own copy), shared by the generation lanes; a copy whose version no batch still needs
takes the next version's weights.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rlhf.runtime.rl.offpolicy.schedule import VersionSchedule


class VersionPool:
    """Policy copies by version (``make_copy`` builds one; ``snapshot_of(v)`` gives version v's weights)."""

    def __init__(self, make_copy: Callable[[], Any], snapshot_of: Callable[[int], Any]):
        self.make_copy, self.snapshot_of = make_copy, snapshot_of
        self.lock = threading.Lock()
        self.copies: dict[int, Any] = {}
        self.free: list[Any] = []

    def get(self, version: int) -> Any:
        """The copy holding ``version`` (loaded the first time it is asked for)."""
        with self.lock:
            copy = self.copies.get(version)
            if copy is None:
                copy = self.free.pop() if self.free else self.make_copy()
                copy.load(self.snapshot_of(version))
                self.copies[version] = copy
            return copy

    def retire(self, below: int) -> None:
        """Versions before ``below`` are needed no more: their copies take other versions later."""
        with self.lock:
            for version in [v for v in self.copies if v < below]:
                self.free.append(self.copies.pop(version))


class PartialRollout:
    """Batch ``step``'s view of the versions: which samples token n, and the engine holding each."""

    def __init__(self, *, step: int, schedule: VersionSchedule, own_engine: Any, pool: VersionPool,
                 published: Callable[[], int], check_stop: Callable[[], None]):
        self.step, self.schedule, self.own_engine, self.pool = step, schedule, own_engine, pool
        self.published, self.check_stop = published, check_stop
        self.longest_wait = 0.0  # seconds: the longest a trajectory of the batch waited for a version

    def version(self, n: int) -> int:
        return self.schedule.version(self.step, n)

    def next_switch(self, n: int) -> int | None:
        return self.schedule.next_switch(self.step, n)

    async def engine(self, version: int) -> Any:
        """The engine that samples from ``version``, once it is published (the event loop goes on meanwhile)."""
        if version == self.schedule.base(self.step):
            return self.own_engine
        began = time.perf_counter()
        while self.published() < version:
            self.check_stop()  # raises when the producer stops
            await asyncio.sleep(0.005)
        self.longest_wait = max(self.longest_wait, time.perf_counter() - began)
        return self.pool.get(version).rollout.engine


def chunk_seed(seed: int | None, token: int) -> int | None:
    """The seed of a turn's request that starts at policy token ``token`` after a version switch."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}/{token}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def behaviour_logprobs(batch: Any, versions: torch.Tensor, logprobs_of: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """(B, A) each action's log-prob under the version that sampled it.

    ``versions``: (B, A) the version of the token each position predicts (-1 off the actions);
    ``logprobs_of(v)``: (B, A) the batch's log-probs under version v."""
    out = torch.zeros(versions.shape, dtype=torch.float32)  # (B, A)
    action = batch.action_mask > 0  # (B, A)
    for version in sorted({int(v) for v in versions[action].tolist()}):
        chosen = action & (versions == version)  # (B, A)
        out = torch.where(chosen, logprobs_of(version).to(out.dtype), out)
    return out


def version_grid(trajectories: list[Any], length: int, default: int) -> torch.Tensor:
    """(B, A) the version of the token at each position t + 1 (A = ``length`` - 1); ``default`` for a
    trajectory without per-token versions, -1 off its tokens."""
    grid = torch.full((len(trajectories), length - 1), -1, dtype=torch.long)  # (B, A)
    for row, trajectory in enumerate(trajectories):
        versions = trajectory.token_versions or [default] * len(trajectory.token_ids)
        values = torch.tensor(versions[1:], dtype=torch.long)  # token t+1 at position t
        grid[row, : values.numel()] = values
    return grid
