"""`WorkerHost`: one Ray actor process holding rank r of one or more roles (placement.py).

A host builds its roles with the local runtime's per-role builders (rlhf/runtime/rl/local.py), in
the local runtime's order (reward sources, adapter, tokenizer, policy, reference, critic,
rollout), right after seeding the way the local runtime seeds itself. So the random numbers a
host draws match the local process's as long as nothing the host does not build drew before it:
see the parity note in rlhf/runtime/ray/__init__.py. Rollout ranks then re-seed with ``seed +
rank`` after building, like every local rank (identically seeded workers would draw the same
numbers), and the critic's head draws from ``seed`` in both runtimes.

Every host builds its own plugin set from installed metadata and reports its fingerprint before
it loads anything heavy; the driver compares (rlhf/runtime/ray/driver.py). Hosts of a group with
data-parallel roles (policy, reference, critic) and more than one rank form a torch.distributed
process group (gloo on CPU, nccl on GPU); the roles then shard their passes exactly as under a
launcher (rlhf/core/distributed.py).

Nothing here imports torch, transformers or rlhf's runtime at module import: the host applies
its environment variables first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_TRAINED = ("policy", "critic")


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class WorkerHost:
    """Rank ``rank`` of every role in ``roles``; methods are called through Ray by groups.py."""

    def __init__(self, group: str, roles: tuple[str, ...], rank: int, world_size: int, *, env: dict[str, str],
                 cwd: str | None, process_group: bool):
        os.environ.update(env)
        from rlhf.runtime.notices import quiet_if_asked

        quiet_if_asked()  # before anything here imports DeepSpeed
        if cwd and os.path.isdir(cwd):  # a local cluster: relative paths and module refs as in the driver
            os.chdir(cwd)
            if cwd not in sys.path:
                sys.path.insert(0, cwd)
        self.group, self.roles, self.rank, self.world_size = group, tuple(roles), rank, world_size
        self.process_group = process_group
        self.workers: dict[str, Any] = {}
        self.plugins: Any = None
        self.rollout_model: Any = None  # the rollout's own copy of the policy, when the policy lives elsewhere

    def hello(self) -> dict[str, Any]:
        """Where this host runs and which plugins it has (cheap: nothing is built yet)."""
        import socket

        import ray

        from rlhf.core.plugin_host.fingerprint import plugin_fingerprint
        from rlhf.core.plugin_host.loading import build_plugin_manager

        if self.plugins is None:
            self.plugins = build_plugin_manager()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "fingerprint": plugin_fingerprint(self.plugins),
                "port": free_port() if self.rank == 0 else None,
                "sync_port": free_port() if self.rank == 0 else None}  # for --weight-sync broadcast

    def setup(self, config: Any, num_prompts: int, master: tuple[str, int] | None) -> dict[str, Any]:
        """Join the group's process group, seed, and build every role this host holds."""
        began = time.perf_counter()
        from rlhf.core.distributed import SINGLE, init_from_environment
        from rlhf.runtime.rl import local
        from rlhf.runtime.run.heap import bound_kernel_caches, return_freed_blocks
        from rlhf.runtime.run.lifecycle import hide_run_data, seed_everything
        from rlhf.runtime.config.train_plan import RunPlan

        bound_kernel_caches()  # before this process's first product, as the driver's prologue (rlhf.runtime.run.heap)
        self.dist = SINGLE
        if self.process_group:
            assert master is not None, "a host group with a process group needs rank 0's address"
            os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(self.rank),
                               "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0"})  # Ray shows each its own GPUs
            self.dist = init_from_environment()
        _quiet_library_progress_bars()
        threads = config.threads or os.environ.get("OMP_NUM_THREADS", "")  # Ray sets it from the actor's CPUs
        if str(threads).isdigit():
            import torch

            torch.set_num_threads(int(threads))
        seed_everything(config.seed)
        roles, plugins, dist = self.roles, self.plugins, self.dist
        if "reward" in roles:
            self.workers["reward"] = local.build_reward(config, plugins)
        self.plan = plan = RunPlan.make(config, plugins).with_prompts(num_prompts)
        hide_run_data(config, plan.out_dir)  # environments run model code in this process too
        return_freed_blocks()  # as the prologue does in the driver's process (rlhf.runtime.run.heap)
        self.adapter = self.tokenizer = None
        if any(role in roles for role in ("policy", "reference", "teacher", "critic", "rollout")):
            self.adapter = local.build_adapter(plan)
        if "rollout" in roles or ("policy" in roles and dist.is_main):  # generation, or the final export
            self.tokenizer = self.adapter.load_tokenizer(config.tokenizer or config.model)
        if "policy" in roles:
            self.workers["policy"] = local.build_policy(plan, self.adapter, dist)
        if "reference" in roles:
            policy_model = self.workers["policy"].model if "policy" in roles else None
            self.workers["reference"] = local.build_reference(plan, self.adapter, dist, policy=policy_model)
        if "teacher" in roles:
            policy_model = self.workers["policy"].model if "policy" in roles else None
            self.workers["teacher"] = local.build_teacher(plan, self.adapter, dist, policy=policy_model)
        if "critic" in roles:
            self.workers["critic"] = local.build_critic(plan, self.adapter, dist)
        if "rollout" in roles:
            synced = {}
            if "policy" in roles:  # the engine reads the policy's own weights: nothing to sync
                model = self.workers["policy"].model
                if self.workers["policy"].backend.shards_weights and dist.active:
                    synced = {"synced_generation": True}  # sharded weights: ranks decode in lockstep
            else:  # a copy of the policy, loaded like the local runtime loads it (same random draws)
                model = self.rollout_model = self.adapter.load(config.model, role="policy").requires_grad_(False)
            trained = (self.workers.get("policy"), self.workers.get("critic"))  # colocated: set aside while generating
            self.workers["rollout"] = local.build_rollout(plan, plugins, model, self.tokenizer, trained=trained,
                                                          **synced)
            # as the local runtime does after building: sampling starts from its own seed, rank r apart
            seed_everything(local.sampling_seed(config.seed, self.rank))
        return {"setup_s": time.perf_counter() - began, "dist_rank": self.dist.rank,
                "world_size": self.dist.world_size}

    # --- calls ----------------------------------------------------------------------------------

    def run(self, role: str, method: str, *args: Any, reply: bool = True, **kwargs: Any) -> Any:
        """``workers[role].method(*args, **kwargs)``; ``reply=False`` returns None (other ranks of a
        data-parallel call hold the same result as rank 0)."""
        result = getattr(self.workers[role], method)(*args, **kwargs)
        return result if reply else None

    def nonfinite(self, role: str) -> int:
        return self.workers[role].nonfinite_in_a_row

    # --- weights for the rollout ----------------------------------------------------------------

    def policy_weights(self) -> dict[str, Any] | None:
        """The policy's trainable parameters on the CPU from rank 0 (frozen ones never change, so never
        travel); called on every rank, as a backend that shards the weights gathers them collectively."""
        policy = self.workers["policy"]
        with policy.backend.full_weights():
            if not self.dist.is_main:
                return None
            return {name: p.detach().cpu().clone() for name, p in policy.model.named_parameters() if p.requires_grad}

    def load_policy_weights(self, weights: dict[str, Any]) -> int:
        """Load the policy's parameters into the rollout's copy; returns the bytes loaded. With
        --verify-weight-sync, every tensor of the copy must then hold exactly what arrived from the object
        store (policy rank 0's copy, `policy_weights`): positional checksums (rlhf/core/weight_check.py)."""
        if self.rollout_model is None:
            return 0  # the engine reads the policy's own weights
        result = self.rollout_model.load_state_dict(weights, strict=False)
        assert not result.unexpected_keys, f"the rollout model has no parameters {result.unexpected_keys[:5]}"
        if self.plan.config.verify_weight_sync:
            from rlhf.core.weight_check import checksum

            self._verify_copy({name: checksum(t, positional=True) for name, t in weights.items()})
        self.workers["rollout"].sync_weights()  # an engine with weights of its own (vllm) takes them now
        return sum(t.numel() * t.element_size() for t in weights.values())

    def _verify_copy(self, expected: dict[str, Any]) -> None:
        """Raise `WeightSyncError` naming the first tensor the rollout's copy holds otherwise than sent
        (``expected``: name -> positional checksum of what the policy sent)."""
        from rlhf.core.weight_check import checksum, first_mismatch, mismatch_error

        held_tensors = dict(self.rollout_model.named_parameters(remove_duplicate=False))
        held = {name: checksum(held_tensors[name], positional=True) for name in expected if name in held_tensors}
        problem = first_mismatch(expected, held)
        if problem is not None:
            count = sum(tuple(held.get(n, ())) != tuple(v) for n, v in expected.items())
            raise mismatch_error(f"rollout actor {self.rank}", problem, count)

    # --- --weight-sync broadcast: a process group of policy rank 0 and the rollout actors ------

    def join_weight_sync(self, address: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join the weight-broadcast group (rank 0: policy rank 0, which serves the rendezvous)."""
        from rlhf.runtime.ray.weight_broadcast import WeightBroadcast

        self.weight_sync = WeightBroadcast.join(address, port, rank, world_size, backend=backend,
                                                timeout_s=self.plan.config.ray_timeout_s)

    def send_policy_weights(self) -> int:
        """Broadcast the policy's trainable parameters from rank 0 (what `policy_weights` puts in the object
        store); called on every policy rank, as a backend that shards the weights gathers them collectively.
        Returns the bytes sent (0 on the other ranks)."""
        policy = self.workers["policy"]
        with policy.backend.full_weights():
            if not self.dist.is_main:
                return 0
            return self.weight_sync.send(((name, p) for name, p in policy.model.named_parameters() if p.requires_grad),
                                         verify=self.plan.config.verify_weight_sync)

    def receive_policy_weights(self) -> int:
        """Receive policy rank 0's broadcast straight into the rollout's copy, verified against the sender's
        checksums (--verify-weight-sync); then an engine with weights of its own (vllm) takes them through its
        load_weights. Returns the bytes received."""
        verify = self.plan.config.verify_weight_sync
        received = self.weight_sync.receive(dict(self.rollout_model.named_parameters(remove_duplicate=False)),
                                            verify=verify)
        if verify:  # what the sender sent against what the model holds now
            self._verify_copy(self.weight_sync.sent_checksums)
        self.workers["rollout"].sync_weights()
        return received

    # --- --async: the producer's copy is this rollout actor's ----------------------------------

    def behaviour_logprobs(self, batch: Any, weights: dict[str, Any] | None = None) -> Any:
        """(B, A) log-probs of a batch under this actor's copy of the policy (the version it samples
        from), or under ``weights`` (`_holding`)."""
        from rlhf.runtime.rl import local
        from rlhf.runtime.rl.workers import model_logprobs

        with self._holding(weights):
            return model_logprobs(self.rollout_model, batch, local.update_settings(self.plan),
                                  temperature=self.plan.config.temperature)

    # --- --on-failure retry: a sample generated again from a seed of its own ---------------------

    def generate_seeded(self, prompts: list[Any], n: int, params: Any, seed: int,
                        weights: dict[str, Any] | None = None) -> Any:
        """The rollout's ``generate`` from a random stream seeded with ``seed``, this process's stream
        put back after (`rlhf.runtime.rl.failures.seeded_stream`, as the local runtime retries), and
        with ``weights`` from those (`_holding`)."""
        from rlhf.runtime.rl.failures import seeded_stream

        with self._holding(weights), seeded_stream(seed):
            return self.workers["rollout"].generate(prompts, n=n, params=params)

    @contextlib.contextmanager
    def _holding(self, weights: dict[str, Any] | None) -> Iterator[None]:
        """The rollout's copy holds ``weights`` (a published version's: a retry under --async) inside,
        and the weights it held before after; both loads as every load is (`load_policy_weights`:
        verified, pushed to an engine with weights of its own). None: the copy as it is."""
        if weights is None:
            yield
            return
        own = {name: p.detach().clone() for name, p in self.rollout_model.named_parameters() if name in weights}
        self.load_policy_weights(weights)
        try:
            yield
        finally:
            self.load_policy_weights(own)

    def swap_rng(self, state: Any, fresh_seed: int) -> Any:
        """Install a random state for sampling (None: one seeded with ``fresh_seed``); return the previous one."""
        import torch

        previous = torch.get_rng_state()
        torch.set_rng_state(state if state is not None else torch.Generator().manual_seed(fresh_seed).get_state())
        return previous

    # --- checkpoints and outputs ----------------------------------------------------------------

    def save(self, role: str, directory: str) -> int | None:
        """The role's state (trained roles) and this process's RNG states into ``directory``."""
        import torch

        from rlhf.runtime.run.checkpoint import rng_state

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        if role in _TRAINED:
            self.workers[role].save(path)
        torch.save(rng_state(), path / f"rng_{self.rank}.pt")
        return self.workers[role].nonfinite_in_a_row if role in _TRAINED else None

    def load(self, role: str, directory: str) -> int | None:
        from rlhf.runtime.run.checkpoint import load_tensors, set_rng_state

        path = Path(directory)
        if role in _TRAINED:
            self.workers[role].load(path)
        rng = path / f"rng_{self.rank}.pt"
        if rng.is_file():
            set_rng_state(load_tensors(rng))  # tensors and plain data only: a crafted file is refused
        else:  # e.g. a checkpoint of the local runtime: sampling continues from this host's seed
            log.warning("%s has no RNG state for %s rank %d; its random numbers restart from the seed",
                        path, role, self.rank)
        return self.workers[role].nonfinite_in_a_row if role in _TRAINED else None

    def export_model(self, out_dir: str) -> None:
        from rlhf.runtime.run.export import export_model
        from rlhf.runtime.run.prompt_format import PromptFormat

        export_model(self.adapter, self.tokenizer, self.workers["policy"], Path(out_dir), self.dist,
                     prompt_format=PromptFormat.of(self.plan.config))

    def export_critic(self, out_dir: str) -> None:
        """The critic as the local runtime saves it (``--save-critic``); called on every rank."""
        from rlhf.runtime.run.export import export_critic

        config = self.plan.config
        tokenizer = self.tokenizer or self.adapter.load_tokenizer(config.tokenizer or config.model)
        export_critic(self.adapter, tokenizer, self.workers["critic"], Path(out_dir), self.dist)


def _quiet_library_progress_bars() -> None:
    """Every actor's 'Loading weights' bar would reach the driver's terminal."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
