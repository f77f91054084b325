"""Ctrl-C (SIGINT) and SIGTERM in the middle of a step leave a checkpoint that ``--resume`` continues
from, ending where an uninterrupted run ends: the same metrics, step for step, and the same final
weights (rlhf/runtime/run/lifecycle.py). The signal is sent by the run's own process from inside
a step (the reward function of ``rlhf train``, the loss of ``rlhf sft``), so it always lands
mid-step: in this process, and once through the command line in a process of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from rlhf.core.errors import RunInterrupted
from tests.helpers import final_weights, read_jsonl, small_config

pytestmark = pytest.mark.run

# The toy task's reward (tests/helpers.py), sending $SIGNAL to its own process on call $SIGNAL_ON_CALL.
SIGNALLING_REWARD = '''
import os, signal
from pathlib import Path

def reward_func(completions, **kwargs):
    counter = Path(os.environ["CALLS_FILE"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    if calls == int(os.environ.get("SIGNAL_ON_CALL", "0")):
        sig = getattr(signal, os.environ["SIGNAL"])
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler, None):
            raise RuntimeError(f"the run has no handler for {sig.name}")  # a test failure, not a killed pytest
        os.kill(os.getpid(), sig)
    return [len(c) / 10 for c in completions]
'''


def comparable(rows):
    """Metrics rows without the timings (and the throughput that follows from them)."""
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and "per_s" not in k}
            for row in rows]


def assert_same_weights(got, expected):
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.fixture
def signalling_task(task, tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(SIGNALLING_REWARD)
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    return tmp_path / "rewards.py"


def rl_config(tiny_model_dir, task, reward, out, **overrides):
    return small_config(tiny_model_dir, task, out, reward=[str(reward)], steps=3, **overrides)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_during_an_rl_step_checkpoints_it_and_resume_ends_as_an_uninterrupted_run(
        sig, tiny_model_dir, task, signalling_task, tmp_path, monkeypatch):
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.rl.local import train

    plugins = build_plugin_manager(load_entrypoints=False)
    whole = train(rl_config(tiny_model_dir, task, signalling_task, tmp_path / "whole"), plugins=plugins)

    monkeypatch.setenv("SIGNAL", sig)
    monkeypatch.setenv("SIGNAL_ON_CALL", "2")  # step 2's reward (each step scores once)
    (tmp_path / "calls").unlink()
    out = tmp_path / "stopped"
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # SIG_IGN under nohup or `cmd &`
    with pytest.raises(RunInterrupted, match=rf"interrupted \({sig}\) after step 2/3; the latest checkpoint is "
                                             rf".*step_2 \(step 2\)"):
        train(rl_config(tiny_model_dir, task, signalling_task, out), plugins=plugins)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # the run's handlers gone
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2]  # step 2 finished
    assert json.loads((out / "checkpoints" / "step_2" / "trainer_state.json").read_text())["step"] == 2
    assert not (out / "final").exists()

    monkeypatch.setenv("SIGNAL_ON_CALL", "0")
    train(rl_config(tiny_model_dir, task, signalling_task, out, resume=True), plugins=plugins)
    assert comparable(read_jsonl(out / "metrics.jsonl")) == comparable(read_jsonl(whole / "metrics.jsonl"))
    assert_same_weights(final_weights(out), final_weights(whole))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_an_sft_step_checkpoints_it_and_resume_ends_as_an_uninterrupted_run(
        sig, tiny_model_dir, fit_data, tmp_path, monkeypatch):
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.plugins.objectives.sft import SFTObjective
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.fit.local import fit

    def config(out, **extra):
        return FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(fit_data / "sft.jsonl")],
                                    "objective": "sft", "batch_size": 4, "micro_batch_size": 2, "steps": 4,
                                    "lr": 1e-3, "out": str(out), "progress": False, "seed": 3, **extra})

    plugins = build_plugin_manager(load_entrypoints=False)
    whole = fit(config(tmp_path / "whole"), plugins=plugins)
    real_loss, calls = SFTObjective.loss, []

    def signalling_loss(self, models, batch, stats):
        calls.append(1)
        if len(calls) == 5:  # the first micro-batch of step 3 (two per step)
            assert signal.getsignal(getattr(signal, sig)) not in (signal.SIG_DFL, signal.default_int_handler)
            os.kill(os.getpid(), getattr(signal, sig))
        return real_loss(self, models, batch, stats)

    monkeypatch.setattr(SFTObjective, "loss", signalling_loss)
    out = tmp_path / "stopped"
    with pytest.raises(RunInterrupted, match=rf"interrupted \({sig}\) after step 3/4"):
        fit(config(out), plugins=plugins)
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert (out / "checkpoints" / "step_3").is_dir() and not (out / "final").exists()
    fit(config(out, resume=True), plugins=plugins)
    assert comparable(read_jsonl(out / "metrics.jsonl")) == comparable(read_jsonl(whole / "metrics.jsonl"))
    assert_same_weights(final_weights(out), final_weights(whole))


def test_sigterm_mid_step_in_a_process_of_its_own_then_resume_from_the_command_line(tiny_model_dir, task,
                                                                                    signalling_task, tmp_path):
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.rl.local import train

    whole = train(rl_config(tiny_model_dir, task, signalling_task, tmp_path / "whole"),
                  plugins=build_plugin_manager(load_entrypoints=False))
    out = tmp_path / "stopped"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(signalling_task), "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "4",
            "--micro-batch-size", "2", "--steps", "3", "--lr", "1e-3", "--seed", "7", "--out", str(out),
            "--no-progress"]
    env = {**os.environ, "RLHF_LOAD_PLUGINS": "", "CALLS_FILE": str(tmp_path / "sub-calls"), "SIGNAL": "SIGTERM",
           "SIGNAL_ON_CALL": "2"}
    stopped = subprocess.run([sys.executable, "-m", "rlhf", *args], env=env, capture_output=True, text=True,
                             timeout=600)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert f"Resume with: rlhf train --config {out / 'config.yaml'} --resume" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    env["SIGNAL_ON_CALL"] = "0"
    resumed = subprocess.run([sys.executable, "-m", "rlhf", "train", "--config", str(out / "config.yaml"),
                              "--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoints/step_2 (step 2)" in resumed.stderr
    assert comparable(read_jsonl(out / "metrics.jsonl")) == comparable(read_jsonl(whole / "metrics.jsonl"))
    assert_same_weights(final_weights(out), final_weights(whole))
