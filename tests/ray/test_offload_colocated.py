"""--colocate all with --offload-train-state and --offload-ref-reward: the policy actor sets its
training state aside while its engine generates and keeps the reference off the device between
uses, and the run is still the local run without either option."""

from __future__ import annotations


import pytest
import torch

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.rl.local import train as local_train
from tests.helpers import final_weights, one_thread, read_jsonl

pytestmark = [pytest.mark.cluster, pytest.mark.ray]


def make_config(model_dir, task, out, **overrides):
    values = dict(model=str(model_dir), data=[str(task / "data.jsonl")], label_key="answer",
                  reward=[str(task / "rewards.py")], prompts_per_step=2, n_samples=2, max_new_tokens=4,
                  micro_batch_size=2, steps=3, lr=1e-2, kl_coef=0.1, out=str(out), progress=False, seed=7)
    values.update(overrides)
    return TrainConfig.from_dict(values)


def test_colocated_offloads_reproduce_the_local_run_without_them(ray_cluster, tiny_model_dir, task, tmp_path):
    from rlhf.runtime.ray import train

    with one_thread():
        local_train(make_config(tiny_model_dir, task, tmp_path / "local"), plugins=build_plugin_manager())
    train(make_config(tiny_model_dir, task, tmp_path / "ray", runtime="ray", colocate="all", policy_cpus=1.0,
                      offload_train_state=True, offload_ref_reward=True), plugins=build_plugin_manager())
    local, ray = (read_jsonl(tmp_path / run / "samples.jsonl") for run in ("local", "ray"))
    assert [(s["step"], s["completion"], s["reward"]) for s in ray] == \
        [(s["step"], s["completion"], s["reward"]) for s in local]
    for a, b in zip(read_jsonl(tmp_path / "local" / "metrics.jsonl"), read_jsonl(tmp_path / "ray" / "metrics.jsonl"),
                    strict=True):
        for key in ("policy/loss", "policy/grad_norm", "kl/mean", "reward/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), (a["step"], key)
    for (name, a), b in zip(final_weights(tmp_path / "local").items(), final_weights(tmp_path / "ray").values()):
        assert torch.allclose(a, b, atol=1e-6), name
