"""A rollout actor's retry (rlhf/runtime/ray/actors.py, ``WorkerHost.generate_seeded``), without Ray: the
retry samples from a stream seeded with its seed, the actor's own stream put back after; with the
weights of its batch's version, which the actor's copy holds for that call only (loaded and put
back the way every load is, verified), and the behaviour log-probs the same way; the driver's
retry copy sends that version's weights with each call (`RayRetryCopy`). The runs are
tests/ray/test_retries_ray.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.core.weight_check import WeightSyncError
from rlhf.runtime.ray.actors import WorkerHost

pytestmark = pytest.mark.unit


def host(seen):
    """A rollout actor whose copy is one linear layer; its rollout records the weight it samples with
    and a draw from the process's stream."""
    actor = object.__new__(WorkerHost)
    actor.rank = 0
    actor.rollout_model = torch.nn.Linear(2, 1, bias=False).requires_grad_(False)
    actor.rollout_model.weight.fill_(1.0)
    actor.plan = SimpleNamespace(config=SimpleNamespace(verify_weight_sync=True))

    def generate(prompts, *, n, params):
        seen.append((list(prompts), n, params, actor.rollout_model.weight.clone(), torch.rand(()).item()))
        return ["sample"]

    actor.workers = {"rollout": SimpleNamespace(generate=generate, sync_weights=lambda: seen.append("synced"))}
    return actor


def test_a_retry_samples_from_its_seed_with_its_version_s_weights_and_the_actor_goes_back_to_its_own():
    seen = []
    actor = host(seen)
    torch.manual_seed(3)
    expected_next = torch.rand(()).item()
    torch.manual_seed(3)
    version = {"weight": torch.full((1, 2), 5.0)}
    assert actor.generate_seeded(["p"], 1, "params", 42, version) == ["sample"]
    # the weights were loaded (and pushed to the engine), sampled with, then the actor's own put back
    assert seen[0] == "synced" and seen[2] == "synced" and len(seen) == 3
    prompts, n, params, weight, draw = seen[1]
    assert (prompts, n, params) == (["p"], 1, "params") and torch.equal(weight, torch.full((1, 2), 5.0))
    assert draw == torch.rand((), generator=torch.Generator().manual_seed(42)).item()  # from the retry's seed
    assert torch.equal(actor.rollout_model.weight, torch.ones(1, 2))
    assert torch.rand(()).item() == expected_next  # the actor's stream as it was

    seen.clear()
    actor.generate_seeded(["q"], 2, "params", 42)  # no weights: the copy as it is, nothing loaded
    assert len(seen) == 1 and torch.equal(seen[0][3], torch.ones(1, 2))


def test_the_behaviour_log_probs_of_a_retried_row_come_from_its_version_s_weights(monkeypatch):
    seen = []
    actor = host(seen)
    import rlhf.runtime.rl.local as local
    import rlhf.runtime.rl.workers as workers

    monkeypatch.setattr(local, "update_settings", lambda plan: None)
    monkeypatch.setattr(workers, "model_logprobs",
                        lambda model, batch, settings, temperature: model.weight.sum().item())
    actor.plan.config.temperature = 1.0
    assert actor.behaviour_logprobs("batch", {"weight": torch.full((1, 2), 2.0)}) == 4.0
    assert actor.behaviour_logprobs("batch") == 2.0  # and the actor's own weights after


def test_a_version_that_does_not_arrive_whole_stops_the_retry(monkeypatch):
    actor = host([])
    real_load = torch.nn.Module.load_state_dict

    def corrupting(module, state, strict=True):  # one element changed on the way into the copy
        result = real_load(module, state, strict=strict)
        module.weight.view(-1)[0] += 1.0
        return result

    monkeypatch.setattr(torch.nn.Linear, "load_state_dict", corrupting, raising=False)
    with pytest.raises(WeightSyncError, match="rollout actor"):
        actor.generate_seeded(["p"], 1, "params", 1, {"weight": torch.full((1, 2), 5.0)})


def test_the_ray_runtime_retries_with_a_copy_that_sends_the_batch_version_with_every_call(tiny_model_dir, task,
                                                                                          tmp_path):
    """--async on Ray: the retry copy is not the lanes' (the rollout actors as they are) but a version's
    weights that go with each call, the retry's generation and its rows' behaviour log-probs."""
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.config.train_plan import RunPlan
    from rlhf.runtime.ray.driver import RayPolicyCopy, RayRetryCopy, make_workers
    from rlhf.runtime.ray.groups import Host
    from tests.helpers import small_config

    plugins = build_plugin_manager()
    plan = RunPlan.make(small_config(tiny_model_dir, task, tmp_path, runtime="ray", async_rollout=True), plugins)
    hosts = [Host(handle=None, group="policy", roles=("policy",), rank=0, info={}),
             Host(handle=None, group="rollout", roles=("rollout",), rank=0, info={})]
    workers = make_workers(plan, plugins, hosts, SimpleNamespace(pad_token_id=0), loader=None)
    assert isinstance(workers.async_parts.make_copy(), RayPolicyCopy)
    retry = workers.async_parts.make_retry_copy()
    assert isinstance(retry, RayRetryCopy) and retry.group is workers.rollout
    calls = []
    retry.group = SimpleNamespace(generate_seeded=lambda prompts, **options: calls.append((prompts, options)) or ["t"],
                                  behaviour_logprobs=lambda batch, weights: calls.append((batch, weights)) or "lp")
    retry.load("the weights of version 3")
    assert retry.rollout.generate_seeded(["p"], n=1, params="params", seed=5) == ["t"]
    assert retry.logprobs("batch") == "lp"
    assert calls == [(["p"], dict(n=1, params="params", seed=5, weights="the weights of version 3")),
                     ("batch", "the weights of version 3")]
