"""The RL loop validates in one place, its plan, before any model loads: what needs whole weights
(``--async``, multi-turn rollouts over several ranks) is refused from the backend's registration
(``shards_weights``, a bool or a function of its config), a third-party backend gets the built-in's
treatment, and a backend whose instance disagrees with its registration stops the run."""

from __future__ import annotations

import pytest

from rlhf.core.errors import ConfigError, PluginError
from rlhf.core.protocols.backend import TrainBackendBase
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.config.train_plan import RunPlan
from tests.helpers import ROOT

pytestmark = pytest.mark.unit


def plan_of(plugins, **options) -> RunPlan:
    return RunPlan.make(TrainConfig(model="m", data=["d"], reward=["exact_match"], **options), plugins)


def test_the_deepspeed_registration_says_when_its_weights_are_sharded(plugins):
    assert plan_of(plugins, backend="deepspeed", components={"backend": {"zero_stage": 3}}).shards_weights
    assert not plan_of(plugins, backend="deepspeed", components={"backend": {"zero_stage": 2}}).shards_weights
    assert not plan_of(plugins).shards_weights


def test_async_on_sharded_weights_is_refused_by_the_plan(plugins):
    plan = plan_of(plugins, backend="deepspeed", components={"backend": {"zero_stage": 3}}, async_rollout=True)
    with pytest.raises(ConfigError, match=r"--async copies the policy's weights .* lower --zero-stage"):
        plan.check(world_size=1)
    plan_of(plugins, backend="deepspeed", components={"backend": {"zero_stage": 2}}, async_rollout=True).check(
        world_size=1)


def test_multi_turn_rollouts_on_sharded_weights_need_one_rank(plugins):
    plan = plan_of(plugins, env="tir", backend="deepspeed", components={"backend": {"zero_stage": 3}})
    plan.check(world_size=1)
    assert not plan.synced_generation(1) and plan.synced_generation(2)
    with pytest.raises(ConfigError, match=r"--env tir on several ranks with a backend that shards the weights"):
        plan.check(world_size=2)
    plan_of(plugins, env="tir", backend="deepspeed", components={"backend": {"zero_stage": 2}}).check(world_size=2)


def test_ray_generates_in_lockstep_only_from_the_policy_actors_own_shards(plugins):
    sharded = {"backend": "deepspeed", "components": {"backend": {"zero_stage": 3}}, "runtime": "ray"}
    assert plan_of(plugins, **sharded, colocate="all", policy_actors=2).synced_generation(1)
    assert not plan_of(plugins, **sharded, colocate="all", policy_actors=1).synced_generation(1)
    assert not plan_of(plugins, **sharded, colocate="none", policy_actors=2).synced_generation(1)


def test_an_agent_runs_on_every_rank_and_rollout_actor_unless_ranks_decode_in_lockstep(plugins):
    """Each rank (torchrun) and each rollout actor (Ray) serves its own agents; ranks that decode in
    lockstep over sharded weights cannot, and an environment is never taken beside an agent."""
    agent = {"agent": f"{ROOT / 'tests' / 'agents' / 'agents.py'}:solve"}
    plan_of(plugins, **agent).check(world_size=2)
    plan_of(plugins, **agent, runtime="ray", policy_actors=2, rollout_workers=2).check(world_size=1)
    sharded = {"backend": "deepspeed", "components": {"backend": {"zero_stage": 3}}}
    plan_of(plugins, **agent, **sharded).check(world_size=1)
    plan_of(plugins, **agent, **sharded, runtime="ray", policy_actors=2).check(world_size=1)  # own copies: whole
    lockstep = r"--agent with the 'deepspeed' backend sharding the weights over several ranks is not supported: .* " \
               r"lower --zero-stage .*, or run one process$"
    with pytest.raises(ConfigError, match=lockstep):
        plan_of(plugins, **agent, **sharded).check(world_size=2)
    with pytest.raises(ConfigError, match=lockstep):
        plan_of(plugins, **agent, **sharded, runtime="ray", colocate="all", policy_actors=2).check(world_size=1)
    with pytest.raises(ConfigError, match=r"^--agent replaces the environment: .* drop --env tir$"):
        plan_of(plugins, **agent, env="tir").check(world_size=1)


def test_the_ray_options_are_checked_by_the_plan(plugins):
    with pytest.raises(ConfigError, match=r"--train-batch-size \(16\) must be a multiple of --policy-actors \(3\)"):
        plan_of(plugins, runtime="ray", prompts_per_step=2, n_samples=8, policy_actors=3).check(world_size=1)
    with pytest.raises(ConfigError, match="--ray-env expects KEY=VALUE, got 'HF_HOME'"):
        plan_of(plugins, runtime="ray", ray_env=["HF_HOME"]).check(world_size=1)
    with pytest.raises(ConfigError, match="use --weight-sync object-store with --async"):
        plan_of(plugins, runtime="ray", weight_sync="broadcast", async_rollout=True).check(world_size=1)


class ShardingBackend(TrainBackendBase):
    """A third-party backend that always partitions its weights, and says so."""

    shards_weights = True

    def __init__(self, model, config):
        self.model = model

    def backward(self, loss):
        loss.backward()

    def step(self):
        return {"grad_norm": 0.0, "lr": 0.0, "skipped": False}

    def zero_grad(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_a_third_party_backend_that_declares_sharding_gets_the_same_checks(plugins, make_plugin):
    plugins.register(make_plugin("sharding_plugin", register_train_backends=lambda register: register(
        "sharding", ShardingBackend, shards_weights=True)))
    plan = plan_of(plugins, backend="sharding", async_rollout=True)
    assert plan.shards_weights
    with pytest.raises(ConfigError, match=r"the 'sharding' backend shards them: use a backend that keeps whole"):
        plan.check(world_size=1)


def test_a_backend_whose_instance_disagrees_with_its_registration_stops_the_run(plugins, make_plugin):
    import torch

    from rlhf.runtime.rl.local import build_backend

    plugins.register(make_plugin("sharding_plugin", register_train_backends=lambda register: register(
        "quiet_sharding", ShardingBackend)))  # shards, but registers shards_weights=False (the default)
    plan = plan_of(plugins, backend="quiet_sharding")
    with pytest.raises(PluginError, match=r"'quiet_sharding' train backend's shards_weights is True but its "
                                          r"registration declares False"):
        build_backend(plan, torch.nn.Linear(2, 2), 1e-3)


def test_components_are_told_the_tokenizer_the_run_loads():
    """Without --tokenizer the run loads the model's own; components get the same name (a reward model
    or an environment that tokenises must agree with the policy)."""
    from rlhf.runtime.config.plan import shared_run_values

    plain = shared_run_values(TrainConfig(model="some/model"))
    assert plain["tokenizer"] == "some/model" and plain["model"] == "some/model"
    assert shared_run_values(TrainConfig(model="some/model", tokenizer="other/tok"))["tokenizer"] == "other/tok"
