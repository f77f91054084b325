"""What the Ray tests share: the run settings for the 2-CPU session cluster, comparing a Ray run with
the local one, and finding the processes a run left."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from rlhf.runtime.config.train_config import TrainConfig
from tests.helpers import read_jsonl

FRACTIONS = {"policy_cpus": 0.5, "ref_cpus": 0.5, "rollout_cpus": 0.5}  # the session cluster has 2 CPUs
TRAINING_KEYS = ("reward/mean", "reward/std", "response/length_mean", "policy/loss", "policy/grad_norm",
                 "policy/clip_frac", "kl/mean")


def make_config(model_dir, task, out, **overrides):
    values = dict(model=str(model_dir), data=[str(task / "data.jsonl")], label_key="answer",
                  reward=[str(task / "rewards.py")], prompts_per_step=2, n_samples=2, max_new_tokens=4,
                  micro_batch_size=2, steps=2, lr=1e-3, out=str(out), progress=False, seed=7, **FRACTIONS)
    values.update(overrides)
    return TrainConfig.from_dict(values)


def samples(out):
    return [(s["step"], s["completion"], s["reward"]) for s in read_jsonl(out / "samples.jsonl")]


def assert_same_training(ray_out, local_out, keys=TRAINING_KEYS, abs_tol=1e-9):
    """Same sampled tokens and rewards; losses equal up to float round-off."""
    assert samples(ray_out) == samples(local_out)
    ray_metrics, local_metrics = read_jsonl(ray_out / "metrics.jsonl"), read_jsonl(local_out / "metrics.jsonl")
    assert [m["step"] for m in ray_metrics] == [m["step"] for m in local_metrics]
    for ray_step, local_step in zip(ray_metrics, local_metrics):
        for key in keys:
            assert ray_step[key] == pytest.approx(local_step[key], rel=1e-5, abs=abs_tol), (ray_step["step"], key)


def final_weights(out):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out / "final").state_dict()


def ray_processes(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if marker in command:
                    found.append(command[:120])
    return found


def actor_processes() -> list[int]:
    """Process ids of live Ray actor processes of the Ray runtime (their title is ray::WorkerHost...) of this
    test session's Ray cluster (their environment has its RAY_TMPDIR): another pytest's actors on the same
    machine are not ours to wait for."""
    ours = f"RAY_TMPDIR={os.environ.get('RAY_TMPDIR', '')}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if not command.startswith("ray::WorkerHost") or state == "Z":
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            environment = [ours]  # unreadable: count it
        if ours in environment:
            found.append(int(entry.name))
    return found
