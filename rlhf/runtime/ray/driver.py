"""The Ray runtime's driver: place the actors, check them, run the shared trainer loop, clean up.

The driver holds what the loop itself needs (the prompt loader, the tokenizer for padding, the
resolved algorithm for advantages) and the lifecycle plugins (loggers); the models live in the
actors. It refuses to run when a worker's plugins differ from its own, and whatever stops the
run (a finished run, an error, Ctrl-C) ends with every actor killed, the placement groups removed
and, when this run started it, the local cluster shut down.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from rlhf.core.distributed import SINGLE
from rlhf.core.errors import PluginError
from rlhf.core.plugin_host.fingerprint import fingerprint_differences, plugin_fingerprint
from rlhf.core.plugin_host.loading import PluginSet, build_plugin_manager
from rlhf.runtime import notices
from rlhf.runtime.run import checkpoint
from rlhf.runtime.config.train_config import TrainConfig, ray_env_pairs
from rlhf.runtime.rl.async_generation import AsyncParts
from rlhf.runtime.rl.local import build_eval_prompts, build_loader, check_teacher_tokenizer
from rlhf.runtime.rl.scoring import Scoring
from rlhf.runtime.config.train_plan import RunPlan
from rlhf.runtime.run.lifecycle import seed_everything, start_run
from rlhf.runtime.rl.workers import RewardWorker
from rlhf.runtime.ray.cluster import Cluster, import_ray
from rlhf.runtime.ray.groups import (CriticGroup, Host, PolicyGroup, ReferenceGroup, RewardGroup, RolloutGroup,
                                     TeacherGroup, WorkerFailedError, wait)
from rlhf.runtime.ray.placement import Layout, create_placement_groups, plan_layout
from rlhf.runtime.rl.trainer import Trainer, Workers

log = logging.getLogger(__name__)

# Passed on to every worker, so each process selects the same plugins as this one.
FORWARDED_ENV = ("RLHF_LOAD_PLUGINS", "RLHF_DISABLE_PLUGINS", "RLHF_DEBUG")


class PluginMismatchError(PluginError):
    """A Ray worker resolved a different plugin set than the driver."""


def train(config: TrainConfig, *, plugins: PluginSet | None = None) -> Path:
    """Run training with the Ray runtime; returns the run directory."""
    import_ray()
    plugins = plugins or build_plugin_manager()
    plan = RunPlan.make(config, plugins)
    # before paying for a cluster. world_size 1: the trainer loop runs once, here, and the actors shard
    # within each call; the models (and their threads) live in the actors
    lock = start_run(plan, plugins, world_size=1, threads=False)
    try:
        seed_everything(config.seed)
        plan, tokenizer, loader = _driver_side(plan)
        layout = plan_layout(config, needs_reference=plan.algorithm.needs_reference,
                             needs_critic=plan.algorithm.needs_critic, has_reward=bool(config.reward),
                             needs_teacher=bool(config.teacher))
        began = time.perf_counter()
        cluster = Cluster.open(config, cpus_needed=layout.cpus, gpus_needed=layout.gpus, out_dir=plan.derived.out_dir)
        try:
            _warn_unused_gpus(layout)
            hosts = launch(layout, config, len(loader), plugins, cluster)
            log.info("Ray runtime ready in %.1f s (cluster %.1f s): %s", time.perf_counter() - began,
                     cluster.seconds, layout.describe())
            workers = make_workers(plan, plugins, hosts, tokenizer, loader)
            if config.weight_sync == "broadcast":
                connect_weight_broadcast(workers.rollout, layout)
            try:
                return Trainer(plan, plugins, workers).run()
            except WorkerFailedError as exc:
                raise type(exc)(f"{exc}\n{resume_hint(plan.derived.out_dir)}") from exc
        finally:
            cluster.close()
    finally:
        lock.release()


def connect_weight_broadcast(rollout: RolloutGroup, layout: Layout) -> None:
    """--weight-sync broadcast: NCCL when the policy and the rollout actors have GPUs, else gloo."""
    if not rollout.own_copy:
        log.warning("--weight-sync broadcast: the rollout shares the policy's actors (--colocate all), so no weights "
                    "travel; nothing to broadcast")
        return
    on_gpus = all(group.resources.gpus > 0 for group in layout.groups
                  if "policy" in group.roles or "rollout" in group.roles)
    rollout.connect_broadcast("nccl" if on_gpus else "gloo")


def _driver_side(plan: RunPlan) -> tuple[RunPlan, Any, Any]:
    """The plan with the data's size, the tokenizer and the prompt loader (no model is loaded here).

    Only the tokenizer is needed: the adapter is built with the actors' settings on this machine's
    CPU and loads no model (an adapter checks what the machine needs for its models, flash-attn or
    a GPU, when it loads one)."""
    adapter_config = plan.component_config("model_adapter", device="cpu")
    adapter = plan.choices["model_adapter"].load()(adapter_config)
    config = plan.config
    tokenizer = adapter.load_tokenizer(config.tokenizer or config.model)
    check_teacher_tokenizer(plan, adapter, tokenizer)  # before any actor loads a model
    loader = build_loader(config, tokenizer)
    return plan.with_prompts(len(loader)), tokenizer, loader


def _warn_unused_gpus(layout: Layout) -> None:
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus and not layout.gpus:
        log.warning("the Ray cluster has %g GPUs but no role asks for one, so every actor runs on the CPU: "
                    "give the roles GPUs with --policy-gpus, --ref-gpus, --critic-gpus, --rollout-gpus", gpus)


def worker_env(config: TrainConfig) -> dict[str, str]:
    env = {"TOKENIZERS_PARALLELISM": "false"}
    env.update({key: os.environ[key] for key in FORWARDED_ENV if key in os.environ})
    env.update(ray_env_pairs(config))
    return env


def launch(layout: Layout, config: TrainConfig, num_prompts: int, plugins: PluginSet, cluster: Cluster) -> list[Host]:
    """Create every host in its placement-group bundle, check plugins, then build the roles."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlhf.runtime.ray.actors import WorkerHost

    timeout = config.ray_timeout_s
    groups = create_placement_groups(layout, timeout)
    cluster.cleanups.append(lambda: [remove_placement_group(pg) for pg in groups])
    remote_host = ray.remote(max_restarts=0)(WorkerHost)
    env = {**worker_env(config), **notices.worker_environment()}  # as quiet as the driver (runtime/notices.py)
    cwd = None if cluster.ships_working_dir else os.getcwd()
    tag = uuid.uuid4().hex[:8]  # actor names stay unique when several runs share a cluster
    hosts: list[Host] = []
    members: list[list[Host]] = []  # per host group, by rank
    cluster.cleanups.append(lambda: kill(hosts))
    for index, (group, pg) in enumerate(zip(layout.groups, groups)):
        members.append([])
        for rank in range(group.size):
            handle = remote_host.options(
                num_cpus=group.resources.cpus, num_gpus=group.resources.gpus,
                name=f"rlhf-{tag}-{index}-{group.name}-{rank}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(group.name, group.roles_of(rank), rank, group.size, env=env, cwd=cwd,
                     process_group=group.needs_process_group)
            members[-1].append(Host(handle=handle, group=group.name, roles=group.roles_of(rank), rank=rank, info={}))
            hosts.append(members[-1][-1])

    for host, info in zip(hosts, wait([(h, h.handle.hello.remote()) for h in hosts], "start", timeout, hosts)):
        host.info = info
    check_fingerprints(plugins, hosts)
    for host in hosts:
        log.info("Ray worker %s: %s", host, ", ".join(host.roles))

    calls = []
    for group, ranks in zip(layout.groups, members):
        master = (ranks[0].info["ip"], ranks[0].info["port"]) if group.needs_process_group else None
        calls += [(h, h.handle.setup.remote(config, num_prompts, master)) for h in ranks]
    for (host, _), built in zip(calls, wait(calls, "setup", timeout, hosts)):
        host.info.update(built)
    return hosts


def check_fingerprints(plugins: PluginSet, hosts: list[Host]) -> None:
    """Every worker must resolve the plugins this process loaded from installed metadata (plugins
    registered in-process, ``source == "inline"``, exist only here: they see the lifecycle events)."""
    inline = {record.name for record in plugins.records if record.source == "inline"}
    expected = {"plugins": {name: version for name, version in plugin_fingerprint(plugins)["plugins"].items()
                            if name not in inline}}
    problems = []
    for host in hosts:
        differences = fingerprint_differences(expected, host.info["fingerprint"])
        if differences:
            problems.append(f"{host}:\n    " + "\n    ".join(differences))
    if problems:
        raise PluginMismatchError(
            "the plugins of these Ray workers differ from this process's, so they would run different code:\n  "
            + "\n  ".join(problems)
            + "\nInstall the same plugin packages (same versions) on every node, and give every process the same "
              "RLHF_LOAD_PLUGINS / RLHF_DISABLE_PLUGINS (see --ray-env).")


def kill(hosts: list[Host]) -> None:
    import ray

    for host in hosts:
        ray.kill(host.handle, no_restart=True)


def make_workers(plan: RunPlan, plugins: PluginSet, hosts: list[Host], tokenizer: Any, loader: Any) -> Workers:
    config = plan.config
    timeout = config.ray_timeout_s

    def holding(role: str) -> list[Host]:
        return sorted((h for h in hosts if role in h.roles), key=lambda h: h.rank)

    policy = PolicyGroup(holding("policy"), timeout, hosts)
    reference = ReferenceGroup(holding("reference"), timeout, hosts) if holding("reference") else None
    teacher = TeacherGroup(holding("teacher"), timeout, hosts) if holding("teacher") else None
    critic = CriticGroup(holding("critic"), timeout, hosts) if holding("critic") else None
    rollout_hosts = holding("rollout")
    rollout = RolloutGroup(rollout_hosts, timeout, hosts, policy, own_copy="policy" not in rollout_hosts[0].roles,
                           sync_timeout_s=config.weight_sync_timeout_s)
    # No reward actor: the environment gives every reward, scored here like in the local runtime.
    reward = RewardGroup(holding("reward"), timeout, hosts) if holding("reward") else RewardWorker(None)

    def export(out_dir: Path, critic_dir: Path | None) -> None:
        """Every rank takes part (a sharding backend gathers the weights); rank 0 writes. The critic
        (--save-critic) goes to ``critic_dir``, default ``<out>/critic``."""
        target = str(Path(out_dir).resolve())
        calls = [(h, h.handle.export_model.remote(target)) for h in policy.hosts]
        if critic is not None and config.save_critic:
            critic_target = str(Path(critic_dir or plan.derived.out_dir / "critic").resolve())
            calls += [(h, h.handle.export_critic.remote(critic_target)) for h in critic.hosts]
        wait(calls, "export", timeout, hosts)

    async_parts = None
    if rollout.own_copy:  # --async: the rollout actors' copies generate ahead, weights pushed by version
        async_parts = AsyncParts(snapshot=policy.snapshot, make_copy=lambda: RayPolicyCopy(rollout, config.seed),
                                 make_retry_copy=lambda: RayRetryCopy(rollout))
    return Workers(policy=policy, rollout=rollout, reward=reward, scoring=Scoring(plan, plugins, reward),
                   reference=reference, teacher=teacher, critic=critic, loader=loader, pad_token_id=tokenizer.pad_token_id,
                   export=export, dist=SINGLE, eval_prompts=build_eval_prompts(config, tokenizer),
                   async_parts=async_parts)


class RayPolicyCopy:
    """--async on Ray: the producer's copy of the policy is the rollout actors' own; it takes a version's
    weights from the object store, computes behaviour log-probs there, and eval (which samples with
    the same actors) swaps in the newest weights and a random stream of its own."""

    evaluates_here = True

    def __init__(self, rollout: RolloutGroup, seed: int):
        self.rollout, self.seed = rollout, seed
        rollout.follow_policy = False

    def load(self, weights: Any) -> None:
        self.rollout.load_weights(weights)

    def logprobs(self, batch: Any) -> Any:
        return self.rollout.behaviour_logprobs(batch)

    def swap_rng(self, states: list[Any] | None) -> list[Any]:
        return self.rollout.swap_rng(states, self.seed + 1_000_003)


class RayRetryCopy:
    """--async on Ray, ``--on-failure retry``: the copy a failed sample is generated again with. It is
    a published version's weights (an object-store reference, ``load``) that the rollout actors take
    for the length of each call only (a retry's generation from its seed, the retried rows'
    behaviour log-probs), then go back to the version the generation thread samples from; the
    retry's seeded stream is the actor's (`RolloutGroup.generate_seeded`). Each such call loads the
    weights twice (there and back): per retried sample, and once for a batch's retried rows."""

    evaluates_here = False

    def __init__(self, rollout: RolloutGroup):
        self.group, self.weights = rollout, None

    @property
    def rollout(self) -> RayRetryCopy:
        """What a retry samples with: this copy (`generate_seeded`)."""
        return self

    def load(self, weights: Any) -> None:
        self.weights = weights

    def generate_seeded(self, prompts: list[Any], *, n: int, params: Any, seed: int) -> list[Any]:
        return self.group.generate_seeded(prompts, n=n, params=params, seed=seed, weights=self.weights)

    def logprobs(self, batch: Any) -> Any:
        return self.group.behaviour_logprobs(batch, self.weights)


def resume_hint(out_dir: Path) -> str:
    latest = checkpoint.latest_checkpoint(out_dir)
    if latest is None:
        return "No checkpoint had been written yet (--save-every N writes one every N steps)."
    return (f"The last complete checkpoint is {latest} (after step {latest.name.removeprefix('step_')}): run the "
            "same command with --resume to continue from it.")
