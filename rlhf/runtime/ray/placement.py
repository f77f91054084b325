"""Where the roles of a Ray run live: host groups, their resources, and placement groups.

A *host* is one Ray actor process; a *host group* is W hosts holding the same roles, one rank of
each per host. Colocated roles share a host group, so rank r of each lives in the same process,
on the same device, in bundle r of the group's placement group (OpenRLHF colocates with separate
actors that each take a fraction of a GPU; one process instead lets a LoRA reference reuse the
policy's base weights and costs one CUDA context, not two):

=================================  =============================================================
``--colocate``                     host groups (``×`` actors)
=================================  =============================================================
``none``                           policy ×P, reference ×R, critic ×C, rollout ×N, [reward ×1]
``policy_ref``                     policy+reference ×P, critic ×C, rollout ×N, [reward ×1]
``critic_reward``                  policy ×P, reference ×R, critic+reward ×C (reward on rank 0),
                                   rollout ×N
``policy_ref`` ``critic_reward``   policy+reference ×P, critic+reward ×C (reward on rank 0),
                                   rollout ×N (both pairs: OpenRLHF's usual 8-GPU PPO layout)
``all``                            policy+reference+critic+rollout ×P (reward on rank 0)
=================================  =============================================================

A ``--teacher`` (on-policy distillation) is a role like the reference and lives where the reference
would (``reference`` above stands for reference+teacher, or the teacher alone when the run has no
reference), with the reference's flags (``--ref-actors``, ``--ref-cpus``, ``--ref-gpus``).

Reward sources are scored by one process, on the whole batch (so per-source metrics and the
failure policy behave as in the local runtime): by a reward actor of its own when a reward model
is among them, when ``--reward-gpus`` is set or with ``--colocate critic_reward``; otherwise by
rollout worker 0, next to the environments. A host requests the resources of the first role it
holds (``--policy-cpus``/``--policy-gpus`` for policy+reference and for ``all``,
``--critic-*`` for critic+reward, ``--rollout-*`` for rollout+reward). Only roles that exist
are placed (no reference when the KL coefficient is 0, no critic without a critic-based
estimator).

On a cluster of several nodes each host group is a PACK placement group of its own, so Ray picks
its node. ``--ray-place ROLE=RESOURCE`` pins the host group holding ROLE to the nodes that have
that Ray resource (one started with ``ray start --resources '{"trainer": 1}'``, or Ray's own
``node:IP``): every actor of the group asks for a token amount of it (`PLACE_AMOUNT`), so a node
with one unit holds up to a thousand of them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.runtime.config.train_config import colocation

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 10.0  # while the cluster has not placed the run yet, say so this often

ROLES = ("policy", "reference", "teacher", "critic", "rollout", "reward")  # also the order a host builds them in
DP_ROLES = ("policy", "reference", "teacher", "critic")  # roles whose ranks form a torch.distributed group
PLACE_AMOUNT = 0.001  # of a --ray-place resource, per actor
# the teacher (--teacher) lives with the reference, in its actors and with its resources
_FLAG_PREFIX = {"policy": "policy", "reference": "ref", "teacher": "ref", "critic": "critic", "rollout": "rollout",
                "reward": "reward"}


@dataclass(frozen=True)
class Resources:
    cpus: float
    gpus: float
    place: str | None = None  # a Ray resource only the nodes meant for these actors have (--ray-place)

    def bundle(self) -> dict[str, float]:
        """A placement-group bundle (zero amounts left out: Ray rejects them)."""
        bundle = {key: value for key, value in (("CPU", self.cpus), ("GPU", self.gpus)) if value > 0}
        if self.place:
            bundle[self.place] = PLACE_AMOUNT
        return bundle


@dataclass(frozen=True)
class HostGroup:
    roles: tuple[str, ...]  # held by every rank
    size: int
    resources: Resources
    rank0_roles: tuple[str, ...] = ()  # held by rank 0 only (the reward sources)

    @property
    def name(self) -> str:
        return "+".join(self.roles + self.rank0_roles)

    def roles_of(self, rank: int) -> tuple[str, ...]:
        held = self.roles + (self.rank0_roles if rank == 0 else ())
        return tuple(role for role in ROLES if role in held)

    @property
    def needs_process_group(self) -> bool:
        return self.size > 1 and any(role in DP_ROLES for role in self.roles)


@dataclass(frozen=True)
class Layout:
    groups: tuple[HostGroup, ...]

    def group_of(self, role: str) -> HostGroup | None:
        return next((g for g in self.groups if role in g.roles + g.rank0_roles), None)

    @property
    def cpus(self) -> float:
        return sum(g.size * g.resources.cpus for g in self.groups)

    @property
    def gpus(self) -> float:
        return sum(g.size * g.resources.gpus for g in self.groups)

    def describe(self) -> str:
        return ", ".join(f"{g.name} ×{g.size} ({g.resources.cpus:g} CPU, {g.resources.gpus:g} GPU each"
                         + (f", on {g.resources.place})" if g.resources.place else ")") for g in self.groups)


def role_resources(config: Any, role: str) -> Resources:
    prefix = _FLAG_PREFIX[role]
    return Resources(cpus=float(getattr(config, f"{prefix}_cpus")), gpus=float(getattr(config, f"{prefix}_gpus")))


def parse_places(items: list[str]) -> dict[str, str]:
    """``--ray-place ROLE=RESOURCE`` items as {role: resource}."""
    places: dict[str, str] = {}
    for item in items:
        role, sep, resource = (part.strip() for part in item.partition("="))
        if not sep or role not in ROLES or not resource:
            raise ConfigError(f"--ray-place expects ROLE=RESOURCE with ROLE one of {', '.join(ROLES)}, got {item!r}")
        if places.get(role, resource) != resource:
            raise ConfigError(f"--ray-place names two places for {role}: {places[role]} and {resource}")
        places[role] = resource
    return places


def names_reward_model(specs: list[str]) -> bool:
    """True when a reward SPEC (``[@WEIGHT]`` stripped) is a directory with a model config, or a
    hub reward model (``org/name``: registered reward names have no ``/``)."""
    from rlhf.rewards.loading import is_hub_reward_model

    for spec in specs:
        head, sep, tail = spec.strip().rpartition("@")
        for text in {spec.strip(), head if sep else spec.strip()}:
            if text and Path(text).is_dir() and (Path(text) / "config.json").is_file():
                return True
            if text and is_hub_reward_model(text, None):
                return True
    return False


def plan_layout(config: Any, *, needs_reference: bool, needs_critic: bool, has_reward: bool,
                needs_teacher: bool = False) -> Layout:
    """The host groups of a run (validates the counts and resources against ``--colocate``); the
    teacher (``needs_teacher``) shares the reference's host group."""
    colocated = colocation(config.colocate)
    everything = colocated == ("all",)
    policy_ref, critic_reward = "policy_ref" in colocated, "critic_reward" in colocated
    policy = _count(config.policy_actors, "--policy-actors")
    for flag, value in (("--ref-actors", config.ref_actors), ("--critic-actors", config.critic_actors),
                        ("--rollout-workers", config.rollout_workers)):
        if value is not None:
            _count(value, flag)
    if (policy_ref or everything) and config.ref_actors not in (None, policy):
        raise ConfigError(f"--colocate {'all' if everything else 'policy_ref'} puts reference rank r into policy "
                          f"actor r, so --ref-actors must equal --policy-actors ({policy}) or be left out; got "
                          f"{config.ref_actors}")
    if everything:
        for flag, value in (("--critic-actors", config.critic_actors), ("--rollout-workers", config.rollout_workers)):
            if value not in (None, policy):
                raise ConfigError(f"--colocate all puts every role into the {policy} policy actor(s), so {flag} must "
                                  f"equal --policy-actors or be left out; got {value}")
    reward_actor = has_reward and (names_reward_model(config.reward) or config.reward_gpus > 0
                                   or critic_reward)
    places = parse_places(config.ray_place)

    def group(roles: tuple[str, ...], size: int, rank0: tuple[str, ...] = ()) -> HostGroup:
        resources = role_resources(config, roles[0])
        if resources.cpus < 0 or resources.gpus < 0 or not resources.bundle():
            raise ConfigError(f"the {'+'.join(roles + rank0)} actors request no resources: give them CPUs or GPUs "
                              f"(e.g. --{_FLAG_PREFIX[roles[0]]}-cpus 1)")
        named = {places[role] for role in roles + rank0 if role in places}
        if len(named) > 1:
            raise ConfigError(f"--ray-place puts the roles of the {'+'.join(roles + rank0)} actors on different "
                              f"resources ({', '.join(sorted(named))}), but they share one process per rank")
        if named:
            resources = Resources(resources.cpus, resources.gpus, place=named.pop())
        return HostGroup(roles=roles, size=size, resources=resources, rank0_roles=rank0)

    reward_role = ("reward",) if has_reward else ()
    frozen = (("reference",) if needs_reference else ()) + (("teacher",) if needs_teacher else ())
    if everything:
        roles = ("policy",) + frozen + (("critic",) if needs_critic else ()) + ("rollout",)
        return Layout((group(roles, policy, reward_role),))

    groups = []
    if policy_ref and frozen:
        groups.append(group(("policy",) + frozen, policy))
    else:
        groups.append(group(("policy",), policy))
        if frozen:
            groups.append(group(frozen, config.ref_actors or 1))
    critic_size = config.critic_actors or 1
    with_critic = critic_reward and needs_critic
    if needs_critic:
        groups.append(group(("critic",), critic_size, reward_role if with_critic else ()))
    groups.append(group(("rollout",), config.rollout_workers or 1, () if reward_actor else reward_role))
    if reward_actor and not with_critic:
        groups.append(group(("reward",), 1))
    return Layout(tuple(groups))


def _count(value: int, flag: str) -> int:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{flag} must be a whole number of at least 1, got {value!r}")
    return value


# --- Ray placement groups ---------------------------------------------------------------------


def never_fits(layout: Layout, total: dict[str, float], nodes: list[dict[str, float]]) -> str | None:
    """Why ``layout`` can never be placed on a cluster with these ``total`` resources and these
    ``nodes`` (each node's total resources), or None when it could once the cluster is free.
    Judged on the nodes up now: a cluster whose autoscaler would add bigger nodes is refused."""
    have = {"CPU": total.get("CPU", 0.0), "GPU": total.get("GPU", 0.0)}
    need = {"CPU": layout.cpus, "GPU": layout.gpus}
    short = [f"{need[k]:g} {k}s (the cluster has {have[k]:g})" for k in ("CPU", "GPU") if need[k] > have[k] + 1e-9]
    if short:
        return f"the run's actors need {' and '.join(short)} in all: {layout.describe()}"
    for group in layout.groups:
        bundle, place = group.resources.bundle(), group.resources.place
        candidates = [node for node in nodes if not place or node.get(place, 0.0) > 0]
        if nodes and not candidates:
            return (f"no node has the Ray resource {place!r} that --ray-place gives the {group.name} actors (start "
                    f"one with ray start --resources '{{\"{place}\": 1}}', or name a node:IP resource)")
        if candidates and not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()) for node in candidates):
            biggest = max(candidates, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)))
            return (f"one {group.name} actor needs {group.resources.cpus:g} CPUs and {group.resources.gpus:g} GPUs on "
                    f"one node, but the largest node{f' with {place}' if place else ''} has "
                    f"{biggest.get('CPU', 0.0):g} CPUs and {biggest.get('GPU', 0.0):g} GPUs")
    return None


def create_placement_groups(layout: Layout, timeout_s: float) -> list[Any]:
    """One PACK placement group per host group (one bundle per rank), ready or an error that says
    what the cluster lacks: at once when the cluster's total resources can never hold the layout,
    else after ``timeout_s``, logging progress while waiting for busy resources to free."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    advice = "Lower --*-cpus/--*-gpus, use fractions, or colocate roles (--colocate)"
    nodes = [{k: float(v) for k, v in n.get("Resources", {}).items()} for n in ray.nodes() if n.get("Alive")]
    reason = never_fits(layout, ray.cluster_resources(), nodes)
    if reason is not None:
        raise ConfigError(f"the Ray cluster can never place this run: {reason}. {advice}")
    groups = [placement_group([g.resources.bundle()] * g.size, strategy="PACK") for g in layout.groups]
    began = time.monotonic()
    pending = [pg.ready() for pg in groups]
    while pending:
        waited = time.monotonic() - began
        if waited >= timeout_s:
            for pg in groups:
                remove_placement_group(pg)
            available = ray.available_resources()
            raise ConfigError(
                f"the Ray cluster could not place the run's actors within {timeout_s:g} s (--ray-timeout-s): they "
                f"need {layout.cpus:g} CPUs and {layout.gpus:g} GPUs in all ({layout.describe()}); "
                f"{available.get('CPU', 0):g} CPUs and {available.get('GPU', 0):g} GPUs are free now (other jobs "
                f"hold the rest). {advice}")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(PROGRESS_EVERY_S, timeout_s - waited))
        if pending:
            available = ray.available_resources()
            log.warning("Waiting for the Ray cluster to place the run's actors (%.0f s of %g s): they need %g CPUs "
                        "and %g GPUs, %g CPUs and %g GPUs are free now", time.monotonic() - began, timeout_s,
                        layout.cpus, layout.gpus, available.get("CPU", 0), available.get("GPU", 0))
    return groups
