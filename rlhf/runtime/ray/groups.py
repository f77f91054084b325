"""Group handles: what the trainer loop calls, fanned out to the Ray actors that hold a role.

Each handle exposes the methods the loop calls on the local workers (`PolicyWorker.fit`,
`RolloutWorker.generate`, ...), so `rlhf.runtime.rl.trainer.Trainer` runs unchanged. A
data-parallel role receives the same full batch on every rank (``ray.put`` once, the reference
passed to each actor); every rank works on its slice and the handle returns rank 0's result,
which is already gathered or reduced over ranks.

Every remote call has a deadline (``--ray-timeout-s``) and waits on all ranks at once, so the
first rank that fails is reported at once (its peers may be blocked in a collective on it). A
dead actor, a timeout or an exception in a worker becomes an `RlhfError` that names the role,
rank, process and node, and the cause.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError, RlhfError
from rlhf.runtime.rl.ranks import regroup

log = logging.getLogger(__name__)


class WorkerFailedError(RlhfError):
    """A Ray worker died, timed out or raised; the run stopped."""


class WorkerDiedError(WorkerFailedError):
    """A Ray worker's process or node went away (killed, out of memory, crashed, node lost)."""


class WorkerTimeoutError(WorkerFailedError):
    """A remote call took longer than --ray-timeout-s."""


@dataclass
class Host:
    """One actor and where it runs (recorded when it started, for error messages)."""

    handle: Any
    group: str  # the host group's name, e.g. "policy+reference"
    roles: tuple[str, ...]  # the roles this host holds
    rank: int
    info: dict[str, Any]

    def __str__(self) -> str:
        info = self.info
        where = f"pid {info['pid']} on node {info['ip']}" if info else "not started"
        if info and info.get("hostname"):
            where += f" ({info['hostname']})"
        return f"{self.group} rank {self.rank} [{where}]"


def wait(calls: list[tuple[Host, Any]], what: str, timeout_s: float, everyone: list[Host] = (),
         flag: str = "--ray-timeout-s") -> list[Any]:
    """Results of remote calls in order; the first failure (any rank) raises at once. ``everyone``
    (all the run's hosts) lets a death be blamed on the actor that died, not on the one whose
    call needed its output. ``flag``: the option that sets ``timeout_s``, named in the error."""
    import ray

    pending = {ref: index for index, (_, ref) in enumerate(calls)}
    results: list[Any] = [None] * len(calls)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = [str(calls[i][0]) for i in sorted(pending.values())]
            raise WorkerTimeoutError(
                f"{what}: no answer within {timeout_s:g} s ({flag}) from {', '.join(late)}; the run "
                f"stopped. Raise {flag} if the work is just slow")
        for ref in ready:
            index = pending.pop(ref)
            try:
                results[index] = ray.get(ref)
            except Exception as exc:
                raise failure(exc, calls[index][0], what, everyone) from exc
    return results


def failure(exc: Exception, host: Host, what: str, everyone: list[Host] = ()) -> RlhfError:
    """The user-facing error for an exception of a remote call."""
    from ray.exceptions import RayActorError, RayError, RayTaskError

    if isinstance(exc, RayActorError) and (match := re.search(r"\bpid: (\d+)", str(exc))):
        host = next((h for h in everyone if h.info and h.info["pid"] == int(match.group(1))), host)
    if isinstance(exc, RayTaskError):  # the worker raised; Ray carries the original exception
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, RayActorError):
            return WorkerDiedError(f"{host} died during {what}: {death_cause(cause)}")
        message = str(cause).strip() if isinstance(cause, RlhfError) else f"{type(cause).__name__}: {cause}"
        kind = ConfigError if isinstance(cause, ConfigError) else WorkerFailedError
        return kind(f"{host} failed during {what}: {message}")
    if isinstance(exc, RayActorError):
        return WorkerDiedError(f"{host} died during {what}: {death_cause(exc)}")
    if isinstance(exc, RayError):  # out of memory, lost objects, a lost node
        return WorkerDiedError(f"{host} failed during {what}: {type(exc).__name__}: {exc}")
    return WorkerFailedError(f"{host} failed during {what}: {type(exc).__name__}: {exc}")


def death_cause(exc: Exception) -> str:
    """Ray's account of an actor's death, without its id lines (class, actor id, pid, ...)."""
    base = getattr(type(exc), "BASE_ERROR_MSG", None)
    useful = [line.strip() for line in str(exc).splitlines()
              if line.strip() and not line.startswith("\t") and line.strip() != base]
    return " ".join(useful) or "its process is gone"


class RoleGroup:
    """The actors holding one role; ``hosts[r]`` holds rank r."""

    def __init__(self, role: str, hosts: list[Host], timeout_s: float, everyone: list[Host]):
        self.role, self.hosts, self.timeout_s, self.everyone = role, hosts, timeout_s, everyone

    def _wait(self, calls: list[tuple[Host, Any]], what: str) -> list[Any]:
        return wait(calls, what, self.timeout_s, self.everyone)

    def _wait_sync(self, calls: list[tuple[Host, Any]], what: str, sync_timeout_s: float | None) -> list[Any]:
        """`_wait` for a weight sync: its deadline is --weight-sync-timeout-s (None or 0: --ray-timeout-s)."""
        if not sync_timeout_s:
            return self._wait(calls, what)
        return wait(calls, what, sync_timeout_s, self.everyone, flag="--weight-sync-timeout-s")

    @property
    def size(self) -> int:
        return len(self.hosts)

    def _on_all(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the role on every rank; rank 0's result."""
        import ray

        args = tuple(ray.put(a) if _is_batch(a) else a for a in args)  # stored once, read by every rank
        calls = [(host, host.handle.run.remote(self.role, method, *args, reply=host.rank == 0, **kwargs))
                 for host in self.hosts]
        return self._wait(calls, f"{self.role}.{method}")[0]

    def _on_hosts(self, method: str, *args: Any) -> list[Any]:
        calls = [(host, getattr(host.handle, method).remote(*args)) for host in self.hosts]
        return self._wait(calls, f"{self.role} {method}")


class TrainedGroup(RoleGroup):
    """Policy or critic: updates, and checkpoint state written by each rank."""

    def __init__(self, role: str, hosts: list[Host], timeout_s: float, everyone: list[Host]):
        super().__init__(role, hosts, timeout_s, everyone)
        self._nonfinite = 0
        self.version = 0  # bumped whenever the weights change (fit, load)

    @property
    def nonfinite_in_a_row(self) -> int:
        return self._nonfinite

    def fit(self, batch: Any, *, step: int, **options: Any) -> dict[str, float]:
        """``options``: passed on to every rank's worker (the policy's ``kl_coef``)."""
        metrics = self._on_all("fit", batch, step=step, **options)
        self.version += 1
        self._nonfinite = self._wait([(self.hosts[0], self.hosts[0].handle.nonfinite.remote(self.role))],
                                     f"{self.role}.nonfinite_in_a_row")[0]
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return self._on_all("state_dict")

    def save(self, directory: Path) -> None:
        self._nonfinite = self._on_hosts("save", self.role, str(Path(directory).resolve()))[0]

    def load(self, directory: Path) -> None:
        self._nonfinite = self._on_hosts("load", self.role, str(Path(directory).resolve()))[0]
        self.version += 1


class PolicyGroup(TrainedGroup):
    def __init__(self, hosts: list[Host], timeout_s: float, everyone: list[Host]):
        super().__init__("policy", hosts, timeout_s, everyone)

    def logprobs(self, batch: Any) -> Any:
        return self._on_all("logprobs", batch)

    def weights_refs(self) -> list[tuple[Host, Any]]:
        """Object-store references to every rank's answer; rank 0's holds the trainable parameters."""
        return [(host, host.handle.policy_weights.remote()) for host in self.hosts]

    def snapshot(self) -> Any:
        """A reference to the current trainable parameters in the object store (kept there while held)."""
        answers = self.weights_refs()
        self._wait(answers[1:], "policy weights")  # the other ranks take part in gathering sharded weights
        return answers[0][1]


class CriticGroup(TrainedGroup):
    def __init__(self, hosts: list[Host], timeout_s: float, everyone: list[Host]):
        super().__init__("critic", hosts, timeout_s, everyone)

    def values(self, batch: Any) -> Any:
        return self._on_all("values", batch)


class ReferenceGroup(RoleGroup):
    def __init__(self, hosts: list[Host], timeout_s: float, everyone: list[Host]):
        super().__init__("reference", hosts, timeout_s, everyone)

    def logprobs(self, batch: Any) -> Any:
        return self._on_all("logprobs", batch)


class TeacherGroup(RoleGroup):
    """--teacher's actors (on-policy distillation): log-probs like the reference's (`ReferenceRole`)."""

    def __init__(self, hosts: list[Host], timeout_s: float, everyone: list[Host]):
        super().__init__("teacher", hosts, timeout_s, everyone)

    def logprobs(self, batch: Any) -> Any:
        return self._on_all("logprobs", batch)


class RewardGroup(RoleGroup):
    """The reward sources, in one process: they score the whole batch as the local runtime does."""

    def __init__(self, hosts: list[Host], timeout_s: float, everyone: list[Host]):
        super().__init__("reward", hosts, timeout_s, everyone)

    def score(self, trajectories: list[Any]) -> Any:
        host = self.hosts[0]
        return self._wait([(host, host.handle.run.remote("reward", "score", trajectories))], "reward.score")[0]


class RolloutGroup(RoleGroup):
    """Rollout actors: prompts are split over them (prompt p to actor p mod N, as `DistContext.shard`
    splits them over launcher ranks) and the trajectories come back in prompt order, groups intact
    and numbered over the whole batch (`rlhf.runtime.rl.ranks.regroup`, as under a launcher).

    Actors holding their own copy of the policy get its weights from policy rank 0 (``sync_weights``,
    after each step), and before a generation whenever the policy changed since the last sync (a
    resumed run: the policy loaded a checkpoint): through the object store, or, once
    `connect_broadcast` made policy rank 0 and the rollout actors a process group
    (``--weight-sync broadcast``), broadcast over it (rlhf/runtime/ray/weight_broadcast.py). Each
    actor verifies what it then holds (``--verify-weight-sync``, in the actor: rlhf/runtime/ray/actors.py)
    and a sync that takes longer than ``sync_timeout_s`` (``--weight-sync-timeout-s``) stops the run.
    """

    stateful = True  # each actor's sampling RNG

    def __init__(self, hosts: list[Host], timeout_s: float, everyone: list[Host], policy: PolicyGroup, *,
                 own_copy: bool, sync_timeout_s: float | None = None):
        super().__init__("rollout", hosts, timeout_s, everyone)
        self.policy, self.own_copy, self.sync_timeout_s = policy, own_copy, sync_timeout_s
        self.follow_policy = True  # sync to the newest policy before generating (--async manages versions itself)
        self.synced_version = 0
        self.last_sync = {"seconds": 0.0, "bytes": 0}
        self.broadcast = False  # --weight-sync broadcast, once connected

    def connect_broadcast(self, backend: str) -> None:
        """Make policy rank 0 (rank 0, serving the rendezvous at its node's address) and every rollout actor
        (ranks 1..N) a process group of their own for the weights; ``backend``: nccl or gloo."""
        if not self.own_copy:
            return
        sender = self.policy.hosts[0]
        address, port, world = sender.info["ip"], sender.info["sync_port"], self.size + 1
        calls = [(sender, sender.handle.join_weight_sync.remote(address, port, 0, world, backend))]
        calls += [(host, host.handle.join_weight_sync.remote(address, port, rank + 1, world, backend))
                  for rank, host in enumerate(self.hosts)]
        self._wait(calls, "joining the weight-broadcast group")
        self.broadcast = True
        log.info("weights: policy rank 0 broadcasts to %d rollout actor(s) over %s (%s:%d)", self.size, backend,
                 address, port)

    def generate(self, prompts: list[Any], *, n: int, params: Any) -> list[Any]:
        return self._generate(prompts, n, lambda handle, shard: handle.run.remote("rollout", "generate", shard, n=n,
                                                                                    params=params))

    def generate_seeded(self, prompts: list[Any], *, n: int, params: Any, seed: int, weights: Any = None
                        ) -> list[Any]:
        """``generate`` from a random stream seeded with ``seed`` in each actor, whose own stream is left
        as it was (a retry: `rlhf.runtime.rl.failures.generate_seeded`); with ``weights`` (an
        object-store reference from `PolicyGroup.snapshot`) the actors sample from those, for this
        call only (a retry under --async: `rlhf.runtime.ray.driver.RayRetryCopy`)."""
        return self._generate(prompts, n, lambda handle, shard: handle.generate_seeded.remote(
            shard, n, params, seed, weights))  # positional: Ray hands the actor what the reference holds

    def _generate(self, prompts: list[Any], n: int, call: Any) -> list[Any]:
        if self.own_copy and self.follow_policy and self.synced_version != self.policy.version:
            self.sync_weights()
        calls = []
        for rank, host in enumerate(self.hosts):
            shard = prompts[rank::self.size]
            if shard:
                calls.append((host, call(host.handle, shard)))
        return regroup(self._wait(calls, "rollout.generate"), n, len(prompts))  # as one process numbers them

    def sync_weights(self) -> None:
        """Push policy rank 0's weights to every rollout actor: broadcast over the weight group, or
        through the object store (fetched once per actor)."""
        if not self.own_copy:
            return
        began = time.perf_counter()
        if self.broadcast:  # every policy rank takes part (sharded weights are gathered collectively)
            sends = [(host, host.handle.send_policy_weights.remote()) for host in self.policy.hosts]
            loads = [(host, host.handle.receive_policy_weights.remote()) for host in self.hosts]
            loaded = self._wait_sync(loads + sends, "rollout receive_policy_weights", self.sync_timeout_s)[: len(loads)]
        else:
            answers = self.policy.weights_refs()
            weights = answers[0][1]  # passed by reference: each rollout actor reads it from the object store
            loads = [(host, host.handle.load_policy_weights.remote(weights)) for host in self.hosts]
            loaded = self._wait_sync(loads + answers[1:], "rollout load_policy_weights",
                                     self.sync_timeout_s)[: len(loads)]
        self.synced_version = self.policy.version
        first = self.last_sync["bytes"] == 0
        self.last_sync = {"seconds": time.perf_counter() - began, "bytes": int(loaded[0])}
        log.log(logging.INFO if first else logging.DEBUG, "weight sync (%s): %d bytes to each of %d rollout actor(s) "
                "in %.3f s", "broadcast" if self.broadcast else "object store", loaded[0], self.size,
                self.last_sync["seconds"])

    def load_weights(self, weights: Any) -> None:
        """Load these policy weights (an object-store reference from `PolicyGroup.snapshot`) into every
        rollout actor's copy."""
        self._wait_sync([(host, host.handle.load_policy_weights.remote(weights)) for host in self.hosts],
                        "rollout load_policy_weights", self.sync_timeout_s)

    def behaviour_logprobs(self, batch: Any, weights: Any = None) -> Any:
        """(B, A) log-probs of a batch under the actors' copy (rollout actor 0 computes them), or under
        ``weights`` (an object-store reference), which actor 0 holds for this call only."""
        host = self.hosts[0]
        return self._wait([(host, host.handle.behaviour_logprobs.remote(batch, weights))],
                          "rollout behaviour_logprobs")[0]

    def swap_rng(self, states: list[Any] | None, fresh_seed: int) -> list[Any]:
        """Install a random state in every rollout actor (None: fresh ones); return the previous ones."""
        calls = [(host, host.handle.swap_rng.remote(None if states is None else states[rank], fresh_seed + rank))
                 for rank, host in enumerate(self.hosts)]
        return self._wait(calls, "rollout swap_rng")

    def save(self, directory: Path) -> None:
        """Each rollout actor's RNG states (its sampling stream), so a resumed run samples the same."""
        self._on_hosts("save", self.role, str(Path(directory).resolve()))

    def load(self, directory: Path) -> None:
        self._on_hosts("load", self.role, str(Path(directory).resolve()))


def _is_batch(value: Any) -> bool:
    from rlhf.core.batch import ExperienceBatch

    return isinstance(value, ExperienceBatch)

