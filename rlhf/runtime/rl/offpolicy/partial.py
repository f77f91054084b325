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

`VersionPool` holds a policy copy per live version, shared by the generation lanes: a batch's
first version and the newer ones alike. A copy whose version no batch in flight still needs takes
another version's weights (``load``, the copy's own path: an engine with weights of its own, vLLM,
then takes them through its weight sync, verified, before its next request). At most K + 1
versions are live at once (`capacity`), so the pool makes that many copies when the run starts and
never more. An engine whose ``generate_one`` may only be awaited from one event loop at a time (any
engine that does not declare ``many_event_loops``; vLLM's) is served, for the lanes together, from
a thread of its own (`rlhf.runtime.rl.offpolicy.served.ServedEngine`).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rlhf.core.errors import RlhfError
from rlhf.runtime.rl.offpolicy.schedule import VersionSchedule
from rlhf.runtime.rl.offpolicy.served import ServedEngine


def capacity(max_staleness: int) -> int:
    """How many policy versions batches in flight need at once, at most (K = ``max_staleness``).

    With a the oldest batch in flight (its rollout or its behaviour log-probs not done), the trainer
    has not trained step a, so no version after a is published: the newest batch in flight is at
    most a + K (batch j starts once its first version, j - K, exists), and none starts before
    version a - K (batch a's first). So the versions in use lie in [a - K, a]: K + 1 of them, as
    long as a version's copy is retired as soon as the oldest batch in flight starts after it (the
    producer retires whenever a batch enters or leaves the flight). The K + 1 generation lanes
    (batches a .. a + K) need them all: with K = 1 two batches each hold one version (their cap,
    step - 1, is their first); with K = 0 one batch holds its step's own."""
    return max_staleness + 1


class VersionPool:
    """A policy copy per live version (``make_copy`` builds one; ``snapshot_of(v)`` gives version v's
    weights): ``size`` copies, made here, each loaded with a version when one is asked for."""

    def __init__(self, make_copy: Callable[[], Any], snapshot_of: Callable[[int], Any], size: int):
        self.snapshot_of = snapshot_of
        self.lock = threading.Lock()
        self.made = [make_copy() for _ in range(size)]
        self.copies: dict[int, Any] = {}
        self.free: list[Any] = list(reversed(self.made))
        self.served: dict[int, ServedEngine] = {}  # id(copy) -> its engine served from a thread of its own

    def get(self, version: int) -> Any:
        """The copy holding ``version`` (loaded the first time it is asked for)."""
        with self.lock:
            copy = self.copies.get(version)
            if copy is None:
                if not self.free:
                    raise RlhfError(f"--partial-rollouts: policy version {version} is needed while versions "
                                    f"{sorted(self.copies)} are still in use, more than the {len(self.made)} "
                                    "the staleness bound allows at once (a bug: please report it)")
                copy = self.free.pop()
                copy.load(self.snapshot_of(version))
                self.copies[version] = copy
            return copy

    def engine(self, version: int) -> Any:
        """The engine that samples from ``version``: its copy's, served from a thread of its own where
        the engine takes one event loop at a time (the lanes' event loops share it)."""
        copy = self.get(version)
        engine = copy.rollout.engine
        if getattr(engine, "many_event_loops", False):
            return engine
        with self.lock:
            if id(copy) not in self.served:
                self.served[id(copy)] = ServedEngine(engine)
            return self.served[id(copy)]

    def retire(self, below: int) -> None:
        """Versions before ``below`` are needed no more: their copies take other versions later."""
        with self.lock:
            for version in [v for v in self.copies if v < below]:
                self.free.append(self.copies.pop(version))

    def close(self) -> None:
        """Stop the engines' threads and what the copies started."""
        for served in self.served.values():
            served.close()
        for copy in self.made:
            close = getattr(copy, "close", None)
            if close is not None:
                close()


class PartialRollout:
    """Batch ``step``'s view of the versions: which samples token n, and the engine holding each."""

    def __init__(self, *, step: int, schedule: VersionSchedule, pool: VersionPool, published: Callable[[], int],
                 check_stop: Callable[[], None]):
        self.step, self.schedule, self.pool = step, schedule, pool
        self.published, self.check_stop = published, check_stop
        self.longest_wait = 0.0  # seconds: the longest a trajectory of the batch waited for a version

    def version(self, n: int) -> int:
        return self.schedule.version(self.step, n)

    def next_switch(self, n: int) -> int | None:
        return self.schedule.next_switch(self.step, n)

    async def engine(self, version: int) -> Any:
        """The engine that samples from ``version``, once it is published (the event loop goes on
        meanwhile; the batch's first version is, before its rollout starts)."""
        if version > self.schedule.base(self.step):
            began = time.perf_counter()
            while self.published() < version:
                self.check_stop()  # raises when the producer stops
                await asyncio.sleep(0.005)
            self.longest_wait = max(self.longest_wait, time.perf_counter() - began)
        return self.pool.engine(version)


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
