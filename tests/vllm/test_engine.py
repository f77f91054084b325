"""The ``vllm`` engine against a fake vLLM (tests/vllm/fakes.py): what it builds and sends, weight
syncs, sleep/wake, and the errors a user meets without vLLM, with the wrong one, or without a GPU."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random

import pytest
import torch

from rlhf.core.errors import ConfigError
from rlhf.core.protocols.rollout import SamplingParams
from rlhf.plugins.engines import vllm_engine
from rlhf.plugins.engines.vllm_engine import (VLLMSetupError, check_version,
                                              require_cuda, require_single_rank, require_vllm)
from rlhf.plugins.engines.vllm_weights import bucket_by_bytes, policy_weights
from tests.vllm import fakes
from tests.vllm.fakes import make_engine

pytestmark = pytest.mark.unit


PARAMS = SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.95, return_logprobs=True)


def test_engine_builds_vllm_from_the_policy(fake_vllm, policy, tiny_model_dir):
    random.seed(11)
    torch.manual_seed(11)
    expected = (random.random(), torch.rand(1))
    random.seed(11)
    torch.manual_seed(11)
    engine = make_engine(policy, seed=5)
    llm = fakes.FakeLLM.instances[0]
    assert llm.kwargs["model"] == str(tiny_model_dir) and llm.kwargs["dtype"] == "float32"
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and llm.kwargs["generation_config"] == "vllm"
    assert llm.kwargs["seed"] == 5 and llm.kwargs["max_model_len"] == 1024 + 8 * 256
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine core runs in this process
    assert (random.random(), torch.rand(1)) == expected  # vLLM's seeding did not move our generators
    assert engine.shares_weights is False and engine.eos_ids == {policy[1].eos_token_id}


def test_generate_sends_rows_and_converts_completions(fake_vllm, policy):
    engine = make_engine(policy)
    eos = policy[1].eos_token_id
    generations = engine.generate([[5, 6, 7], [8]], n=2, params=PARAMS)
    llm = fakes.FakeLLM.instances[0]
    assert llm.prompts == [[5, 6, 7], [5, 6, 7], [8], [8]]
    assert llm.sampling.kwargs["temperature"] == 0.8 and llm.sampling.kwargs["top_p"] == 0.95
    assert llm.sampling.kwargs["stop_token_ids"] == [eos] and llm.sampling.kwargs["logprobs"] == 0
    assert [g.token_ids for g in generations] == [[3, eos], [3, eos], [1, eos], [1, eos]]
    assert {g.finish_reason for g in generations} == {"stop"}
    assert [g.logprobs for g in generations] == [[-0.5, -0.25]] * 4


def test_first_generation_pushes_the_policy_weights(fake_vllm, policy):
    model = policy[0]
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    engine.generate([[5]], n=1, params=PARAMS)
    loaded = llm.worker.model.loaded
    assert list(loaded) == [name for name, _ in model.named_parameters()]
    for name, param in model.named_parameters():
        assert torch.equal(loaded[name], param), name
    assert llm.calls == ["collective_rpc", "reset_prefix_cache", "generate"]
    assert engine.last_sync_bytes == sum(p.numel() * p.element_size() for p in model.parameters())

    engine.generate([[5]], n=1, params=PARAMS)  # nothing changed: no push
    assert llm.calls[3:] == ["generate"]


def test_a_changed_policy_is_pushed_before_generating(fake_vllm, policy):
    model = policy[0]
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    engine.load_weights(None)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # an optimizer step writes in place like this
    engine.generate([[5]], n=1, params=PARAMS)
    assert llm.calls == ["collective_rpc", "reset_prefix_cache", "collective_rpc", "reset_prefix_cache", "generate"]
    assert torch.equal(llm.worker.model.loaded["model.norm.weight"], model.model.norm.weight)


def test_weights_travel_in_buckets(fake_vllm, policy):
    model = policy[0]
    engine = make_engine(policy, sync_bucket_mb=0.05)
    engine.load_weights(None)
    batches = fakes.FakeLLM.instances[0].worker.model.batches
    expected = [[n for n, _ in b] for b in bucket_by_bytes(policy_weights(model), int(0.05 * 2**20))]
    assert batches == expected and len(batches) > 1


def test_a_state_dict_is_loaded_under_checkpoint_names(fake_vllm, policy):
    engine = make_engine(policy)
    engine.load_weights({"module.model.norm.weight": torch.full((64,), 2.0)})
    llm = fakes.FakeLLM.instances[0]
    assert list(llm.worker.model.loaded) == ["model.norm.weight"]
    assert torch.all(llm.worker.model.loaded["model.norm.weight"] == 2.0)
    assert llm.calls == ["collective_rpc", "reset_prefix_cache"]
    engine.generate([[5]], n=1, params=PARAMS)  # an explicit load counts as in sync
    assert llm.calls[2:] == ["generate"]


def test_sleep_needs_sleep_mode(fake_vllm, policy):
    engine = make_engine(policy)
    for call in (engine.sleep, engine.wake_up):
        with pytest.raises(ConfigError, match="enable_sleep_mode"):
            call()


def test_auto_sleep_cycle(fake_vllm, policy):
    engine = make_engine(policy, enable_sleep_mode=True, auto_sleep=True, sleep_level=2)
    llm = fakes.FakeLLM.instances[0]
    engine.generate([[5]], n=1, params=PARAMS)
    assert llm.calls == ["collective_rpc", "reset_prefix_cache", "generate", ("sleep", 2)]
    engine.load_weights(None)  # the sync after a training step wakes only the weights
    assert llm.calls[4:] == [("wake_up", ["weights"]), "collective_rpc", "reset_prefix_cache"]
    engine.generate([[5]], n=1, params=PARAMS)  # then the KV cache; the weights are fresh
    assert llm.calls[7:] == [("wake_up", ["kv_cache"]), "generate", ("sleep", 2)]
    engine.generate([[5]], n=1, params=PARAMS)  # level 2 dropped the weights: they are pushed again
    assert llm.calls[10:] == [("wake_up", None), "collective_rpc", "reset_prefix_cache", "generate", ("sleep", 2)]


def test_manual_sleep_and_wake(fake_vllm, policy):
    engine = make_engine(policy, enable_sleep_mode=True)
    llm = fakes.FakeLLM.instances[0]
    engine.load_weights(None)
    engine.sleep()
    engine.sleep()  # already asleep: nothing to do
    engine.wake_up()
    engine.wake_up()  # already awake
    engine.generate([[5]], n=1, params=PARAMS)  # level 1 kept the weights: no push
    assert llm.calls == ["collective_rpc", "reset_prefix_cache", ("sleep", 1), ("wake_up", None), "generate"]
    with pytest.raises(ConfigError, match="wake_up tags"):
        engine.wake_up(["everything"])
    with pytest.raises(ConfigError, match="sleep level"):
        engine.sleep(level=3)


# --- errors a user can meet ------------------------------------------------------------------


def test_missing_vllm_says_how_to_install_it(monkeypatch):
    real_version = importlib.metadata.version

    def version(name):
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(VLLMSetupError, match=r'pip install "rlhf-core\[vllm\]"'):
        require_vllm()


@pytest.mark.parametrize("installed", ["0.10.1", "0.9.2", "0.34.0", "1.0.0", "nightly"])
def test_unsupported_versions_name_both(installed, monkeypatch):
    monkeypatch.delenv(vllm_engine.SKIP_VERSION_CHECK, raising=False)
    with pytest.raises(VLLMSetupError) as error:
        check_version(installed)
    assert f"vLLM {installed} is installed" in str(error.value) and "vllm>=0.10.2,<0.34" in str(error.value)


@pytest.mark.parametrize("installed", ["0.10.2", "0.11.0", "0.12.0+cu128", "0.33.0", "0.33.1rc1.dev12+g1234"])
def test_supported_versions_pass(installed, monkeypatch):
    monkeypatch.delenv(vllm_engine.SKIP_VERSION_CHECK, raising=False)
    check_version(installed)


def test_the_version_check_can_be_skipped(monkeypatch):
    monkeypatch.setenv(vllm_engine.SKIP_VERSION_CHECK, "1")
    check_version("0.40.0")


def test_no_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(VLLMSetupError, match="needs a CUDA GPU.*--engine hf"):
        require_cuda()


def test_several_ranks_in_one_group_are_refused(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(VLLMSetupError, match="one of 2 data-parallel ranks"):
        require_single_rank()


def test_rlhf_train_engine_vllm_without_vllm(tiny_model_dir, tmp_path, monkeypatch, plugins):
    """Selecting the engine on the command line reaches the engine and its message (exit 2)."""
    from tests.helpers import run_cli

    real_version = importlib.metadata.version

    def version(name):
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_func(completions, **kwargs):\n    return [0.0 for _ in completions]\n")
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(data), "--reward", str(reward),
                               "--engine", "vllm", "--steps", "1", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert 'pip install "rlhf-core[vllm]"' in result.output
