"""--weight-sync broadcast: policy rank 0 broadcasts its weights to the rollout actors over a
process group of their own (gloo here) and they hold, after every step, exactly what the object
store would have delivered; the runs are the same to the bit."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.config.train_config import TrainConfig
from tests.helpers import final_weights, read_jsonl

pytestmark = [pytest.mark.cluster, pytest.mark.ray]

FRACTIONS = {"policy_cpus": 0.5, "ref_cpus": 0.5, "rollout_cpus": 0.5}  # the session cluster has 2 CPUs


def make_config(model_dir, task, out, **overrides):
    values = dict(model=str(model_dir), data=[str(task / "data.jsonl")], label_key="answer",
                  reward=[str(task / "rewards.py")], prompts_per_step=2, n_samples=2, max_new_tokens=4,
                  micro_batch_size=2, steps=3, lr=1e-2, out=str(out), progress=False, seed=7, runtime="ray",
                  kl_coef=0.0, **FRACTIONS)
    values.update(overrides)
    return TrainConfig.from_dict(values)


def rollout_copy(host):
    """The rollout actor's own copy of the policy, as it is now."""
    import ray

    def read(actor):
        return {name: t.detach().clone() for name, t in actor.rollout_model.state_dict().items()}

    return ray.get(host.handle.__ray_call__.remote(read))


def fixed_batch(seed):
    """4 trajectories (2 prompts x 2) of different lengths, with GRPO advantages and old log-probs to come."""
    from rlhf.algorithms import compute_advantages, resolve_algorithm
    from rlhf.core.batch import collate
    from rlhf.core.types import Trajectory

    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for row in range(4):
        prompt = torch.randint(5, 300, (3 + row % 2,), generator=generator).tolist()
        completion = torch.randint(5, 300, (2 + row % 3,), generator=generator).tolist()
        trajectories.append(Trajectory(token_ids=prompt + completion, loss_mask=[0] * len(prompt) + [1] * len(completion),
                                       prompt_length=len(prompt), prompt="", prompt_text="", completion_text="",
                                       group=row // 2))
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.75])
    batch = collate(trajectories, pad_token_id=0, rewards=rewards, sample_mask=torch.ones(4))
    algorithm = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0)
    batch.advantages, batch.returns = compute_advantages(algorithm.advantage, rewards=batch.rewards,
                                                         action_mask=batch.action_mask, group_size=2)
    return batch


def test_broadcast_delivers_what_the_object_store_delivers(ray_cluster, tiny_model_dir, task, tmp_path):
    """One policy actor, two rollout actors with their own copies: one synced through the object store,
    one by broadcast. After each update and sync both copies equal policy rank 0's weights to the bit."""
    import dataclasses

    from rlhf.runtime.ray.cluster import Cluster
    from rlhf.runtime.ray.driver import launch
    from rlhf.runtime.ray.groups import PolicyGroup, RolloutGroup
    from rlhf.runtime.ray.placement import HostGroup, Layout, Resources

    config = make_config(tiny_model_dir, task, tmp_path / "run")
    half_cpu = Resources(0.5, 0.0)
    layout = Layout((HostGroup(("policy",), 1, half_cpu), HostGroup(("rollout",), 1, half_cpu),
                     HostGroup(("rollout",), 1, half_cpu)))
    cluster = Cluster.open(config, cpus_needed=1.5, gpus_needed=0, out_dir=tmp_path / "run")
    try:
        hosts = launch(layout, config, 8, build_plugin_manager(), cluster)
        policy = PolicyGroup(hosts[:1], 120, hosts)
        by_store = RolloutGroup(hosts[1:2], 120, hosts, policy, own_copy=True)
        by_broadcast = RolloutGroup(hosts[2:], 120, hosts, policy, own_copy=True)
        by_broadcast.connect_broadcast("gloo")
        start = rollout_copy(hosts[2])
        for step in range(2):
            batch = fixed_batch(step)
            batch = dataclasses.replace(batch, old_logprobs=policy.logprobs(batch))  # (B, A)
            policy.fit(batch, step=step)
            by_store.sync_weights()
            by_broadcast.sync_weights()
            trained = policy.state_dict()["model"]
            from_store, from_broadcast = rollout_copy(hosts[1]), rollout_copy(hosts[2])
            assert from_store.keys() == from_broadcast.keys() == trained.keys()
            for name, weight in trained.items():
                assert torch.equal(from_broadcast[name], weight), (step, name)
                assert torch.equal(from_store[name], weight), (step, name)
            assert any(not torch.equal(start[name], w) for name, w in from_broadcast.items()), "nothing trained"
            start = from_broadcast
            nbytes = sum(p.numel() * p.element_size() for p in trained.values())  # every parameter trains here
            assert by_broadcast.last_sync["bytes"] == by_store.last_sync["bytes"] == nbytes
    finally:
        cluster.close()


def test_a_broadcast_run_is_the_object_store_run(ray_cluster, tiny_model_dir, task, tmp_path):
    """The same samples (drawn from the synced copies at steps 2 and 3), losses and final weights, to the bit."""
    from rlhf.runtime.ray import train

    runs = {}
    for way in ("object-store", "broadcast"):
        out = tmp_path / way
        train(make_config(tiny_model_dir, task, out, weight_sync=way), plugins=build_plugin_manager())
        runs[way] = out
    store, broadcast = (read_jsonl(runs[w] / "samples.jsonl") for w in ("object-store", "broadcast"))
    assert [(s["step"], s["completion"], s["reward"]) for s in broadcast] == \
        [(s["step"], s["completion"], s["reward"]) for s in store]
    assert {s["step"] for s in store} == {1, 2, 3}
    store_metrics, broadcast_metrics = (read_jsonl(runs[w] / "metrics.jsonl") for w in ("object-store", "broadcast"))
    for a, b in zip(store_metrics, broadcast_metrics, strict=True):
        assert a["policy/loss"] == b["policy/loss"] and a["policy/grad_norm"] == b["policy/grad_norm"]
        assert b["time/sync"] > 0
    for (name, a), b in zip(final_weights(runs["object-store"]).items(), final_weights(runs["broadcast"]).values()):
        assert torch.equal(a, b), name


def test_broadcast_is_refused_with_async(tiny_model_dir, task, tmp_path):
    from rlhf.runtime.ray import train

    config = make_config(tiny_model_dir, task, tmp_path / "run", weight_sync="broadcast", async_rollout=True)
    with pytest.raises(ConfigError, match="--async .* --weight-sync object-store"):
        train(config, plugins=build_plugin_manager())


DROPPED = "model.layers.1.mlp.down_proj.weight"


def leave_stale_after_the_first_sync(actor, name, way):
    """Inside a rollout actor: from the second sync on, ``name`` of its copy is left as it was (the
    object store's load skips it; the broadcast lands in a stand-in tensor), as MoE experts once were."""
    model = actor.rollout_model
    if way == "object-store":
        load = model.load_state_dict

        def skipping(state, strict=True):
            return load({key: value for key, value in state.items() if key != name}, strict=strict)

        model.load_state_dict = skipping
    else:
        named = model.named_parameters

        def elsewhere(*args, **kwargs):
            return ((key, value.detach().clone() if key == name else value) for key, value in named(*args, **kwargs))

        model.named_parameters = elsewhere


def test_every_sync_is_verified_and_a_hung_one_stops_in_time(ray_cluster, tiny_model_dir, task, tmp_path):
    """Both ways of --weight-sync verify by default: a tensor a rollout actor's copy does not take after the
    first sync stops the run with one line naming it and the actor; a sync that hangs (a broadcast whose
    sender never sends) stops at --weight-sync-timeout-s with one line."""
    import dataclasses

    import ray

    from rlhf.runtime.ray.cluster import Cluster
    from rlhf.runtime.ray.driver import launch
    from rlhf.runtime.ray.groups import PolicyGroup, RolloutGroup, WorkerFailedError, WorkerTimeoutError
    from rlhf.runtime.ray.placement import HostGroup, Layout, Resources

    config = make_config(tiny_model_dir, task, tmp_path / "run")
    assert config.verify_weight_sync and config.weight_sync_timeout_s == 600  # the defaults
    half_cpu = Resources(0.5, 0.0)
    layout = Layout((HostGroup(("policy",), 1, half_cpu), HostGroup(("rollout",), 1, half_cpu),
                     HostGroup(("rollout",), 1, half_cpu)))
    cluster = Cluster.open(config, cpus_needed=1.5, gpus_needed=0, out_dir=tmp_path / "run")
    try:
        hosts = launch(layout, config, 8, build_plugin_manager(), cluster)
        policy = PolicyGroup(hosts[:1], 120, hosts)
        groups = {"object-store": RolloutGroup(hosts[1:2], 120, hosts, policy, own_copy=True),
                  "broadcast": RolloutGroup(hosts[2:], 120, hosts, policy, own_copy=True)}
        groups["broadcast"].connect_broadcast("gloo")
        for way, group in groups.items():
            group.sync_weights()  # sound: verified and passed
            ray.get(group.hosts[0].handle.__ray_call__.remote(leave_stale_after_the_first_sync, DROPPED, way))
        batch = fixed_batch(0)
        policy.fit(dataclasses.replace(batch, old_logprobs=policy.logprobs(batch)), step=0)
        for way, group in groups.items():
            with pytest.raises(WorkerFailedError) as caught:
                group.sync_weights()
            message = str(caught.value)
            assert "\n" not in message, message
            assert f"weight sync to rollout actor 0 failed verification: {DROPPED} holds other values" in message
            assert "rollout rank 0" in message and "--no-verify-weight-sync" in message

        class NoSender:  # a broadcast whose sender never comes: the receiver waits in gloo
            hosts: list = []
            version = 1

        hung = RolloutGroup(hosts[2:], 120, hosts, NoSender(), own_copy=True, sync_timeout_s=2)
        hung.broadcast = True
        with pytest.raises(WorkerTimeoutError) as caught:
            hung.sync_weights()
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("rollout receive_policy_weights: no answer within 2 s (--weight-sync-timeout-s)")
    finally:
        cluster.close()
