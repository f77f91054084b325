"""`rlhf train --ray-address` on a two-node Ray cluster (two nodes on this machine, each with a
resource of its own): ``--ray-place`` puts the policy on one node and the rollout on the other,
the run reproduces the local run, and the bytes that cross between the nodes each step are
measured (printed with ``pytest -s``; README, "More processes")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import rlhf
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.local import train as local_train
from tests.helpers import one_thread, read_jsonl
from tests.ray.runs import assert_same_training, final_weights, make_config, ray_processes

pytestmark = [pytest.mark.cluster, pytest.mark.ray]

REPO = Path(rlhf.__file__).resolve().parents[1]
STEPS = 2


@pytest.fixture
def work():
    path = Path(tempfile.mkdtemp(prefix="rlhf-2n-"))  # short: Ray's socket paths live under RAY_TMPDIR
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def two_node_run(work, tiny_model_dir, task):
    """The run on the two-node cluster (tests/ray/two_nodes.py); its report."""
    for name in ("data.jsonl", "rewards.py"):
        (work / name).write_text((task / name).read_text())
    env = {**os.environ, "RAY_TMPDIR": str(work / "ray"), "RLHF_LOAD_PLUGINS": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    args = ["--colocate", "policy_ref", "--policy-cpus", "0.5", "--rollout-cpus", "0.5",
            "--ray-place", "policy=node_a", "--ray-place", "rollout=node_b",
            "--model", str(tiny_model_dir), "--data", "data.jsonl", "--label-key", "answer",
            "--reward", "rewards.py", "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "4",
            "--micro-batch-size", "2", "--steps", str(STEPS), "--lr", "1e-3", "--seed", "7", "--no-progress",
            "--out", str(work / "run")]
    result = subprocess.run([sys.executable, "-m", "tests.ray.two_nodes", str(work / "report.json"), "--", *args],
                            capture_output=True, text=True, env=env, cwd=work, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"run finished: {work / 'run'}" in result.stdout
    assert ray_processes(str(work / "ray")) == []  # both nodes' raylets, the GCS and the actors are gone
    return json.loads((work / "report.json").read_text())


@pytest.mark.timeout(600)
def test_policy_and_rollout_on_two_nodes_reproduce_the_local_run(tiny_model_dir, task, work):
    report = two_node_run(work, tiny_model_dir, task)
    with one_thread():
        local_train(make_config(tiny_model_dir, task, work / "local"), plugins=build_plugin_manager())

    # (a) two nodes, and each role on the node --ray-place named
    node_of = {resources[0]: node for node, resources in report["nodes"].items()}
    assert sorted(node_of) == ["node_a", "node_b"] and node_of["node_a"] != node_of["node_b"]
    assert sorted((h["group"], h["rank"], h["node_id"]) for h in report["hosts"]) == [
        ("policy+reference", 0, node_of["node_a"]), ("rollout+reward", 0, node_of["node_b"])]

    # (b) the local run's samples, rewards, losses and final weights
    run = work / "run"
    assert_same_training(run, work / "local")
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[1]["policy/loss"] != metrics[0]["policy/loss"]  # step 2 sampled from weights synced over nodes
    for (name, a), b in zip(final_weights(work / "local").items(), final_weights(run).values()):
        assert torch.allclose(a, b, atol=1e-6), name

    # What crosses between the nodes each step: the policy's parameters (all trainable here, float32)
    # to the rollout node after each update; prompts there, trajectories back, and (rollout worker 0
    # scores the Python reward) the trajectories there again and their rewards back.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    parameters = sum(p.numel() for p in model.parameters())
    assert report["weights"] == [parameters * 4] * STEPS
    assert all(parameters * 4 < size < parameters * 4 + 64 * 1024 for size in report["weights_payload"])
    for key in ("prompts", "trajectories", "score_args", "score_result"):
        assert len(report[key]) == STEPS and all(size > 0 for size in report[key]), key
    samples = read_jsonl(run / "samples.jsonl")
    tokens = sum(len(s["completion"]) for s in samples)  # characters: a floor on what a trajectory holds
    assert all(size > tokens // STEPS for size in report["trajectories"])
    batches = {(role, method) for role, method, _ in report["batches"]}
    assert batches == {("reference", "logprobs"), ("policy", "fit")}  # one update per batch: no old log-probs pass
    per_step = {key: report[key][-1] for key in ("weights_payload", "prompts", "trajectories", "score_args",
                                                 "score_result")}
    driver = "node_a" if report["driver_node"] == node_of["node_a"] else "node_b"
    print(f"\ntwo nodes, {parameters} parameters (float32), {len(samples) // STEPS} samples of <= 4 new tokens per "
          f"step; the driver on {driver}; bytes per step: " + ", ".join(f"{k} {v}" for k, v in per_step.items())
          + f"; experience batch to the policy node {max(b for _, _, b in report['batches'])}")
