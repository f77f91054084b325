"""`rlhf train` end to end on the tiny model: the run directory, config files, lifecycle hooks,
exact resume, PPO with a critic, NaN handling and errors that name the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import rlhf
import yaml

from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.rl.local import train
from tests.helpers import final_weights, read_jsonl, run_cli, small_config


@pytest.mark.run
def test_cli_run_writes_a_complete_run_directory(tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    args = ["--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", f"{task / 'rewards.py'}:reward_func", "--prompts-per-step", "2", "--n-samples", "3",
            "--max-new-tokens", "4", "--steps", "2", "--lr", "1e-3", "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "rlhf", "train", *args], capture_output=True, text=True,
                            env={**os.environ, "RLHF_LOAD_PLUGINS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2/2" in result.stderr and "run finished" in result.stdout

    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward/mean", "kl/mean", "policy/loss", "policy/clip_frac", "time/rollout",
                "throughput/tokens_per_s", "response/length_mean"):
        assert key in metrics[0], key
    phases = {k: v for k, v in metrics[0].items() if k.startswith("time/") and k != "time/step"}
    assert set(phases) == {"time/rollout", "time/reward", "time/experience", "time/train", "time/sync"}
    assert all(0 <= v <= metrics[0]["time/step"] for v in phases.values()) and sum(phases.values()) <= \
        metrics[0]["time/step"]
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 2 * 2 * 3 and {s["step"] for s in samples} == {1, 2}
    assert samples[0]["reward"] == pytest.approx(len(samples[0]["completion"]) / 10)
    assert set(samples[0]) >= {"prompt", "completion", "label", "rewards", "finish_reason"}

    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert TrainConfig.from_dict(saved).n_samples == 3
    plugins = json.loads((out / "plugins.json").read_text())
    assert plugins["fingerprint"]["plugins"]["rlhf.plugins.algorithms.plugin"].startswith("rlhf-core==")
    assert (out / "checkpoints" / "step_2" / "policy" / "state.pt").is_file()

    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [not torch.equal(a, b) for a, b in zip(final.parameters(), initial.parameters())]
    assert any(changed), "training did not change the weights"


@pytest.mark.run
def test_config_file_supplies_values_and_flags_override_it(tiny_model_dir, task, tmp_path, plugins):
    config = {"model": str(tiny_model_dir), "data": str(task / "data.jsonl"), "label-key": "answer",
              "reward": [str(task / "rewards.py")], "steps": 1, "n_samples": 2, "prompts_per_step": 2,
              "max_new_tokens": 3, "reward_options": {"on_error": "zero"}, "progress": False}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    result = run_cli(plugins, ["train", "--config", str(tmp_path / "run.yaml"), "--steps", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = TrainConfig.from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    assert (saved.steps, saved.n_samples, saved.max_new_tokens) == (2, 2, 3)
    assert saved.reward_options.on_error == "zero"
    assert len(read_jsonl(out / "metrics.jsonl")) == 2


@pytest.mark.unit
def test_config_file_with_an_unknown_key_is_a_usage_error(tmp_path, plugins):
    (tmp_path / "run.yaml").write_text("model: x\nn_sample: 4\n")
    result = run_cli(plugins, ["train", "--config", str(tmp_path / "run.yaml")])
    assert result.exit_code == 2 and "unknown option(s) n_sample" in result.output


@pytest.mark.run
def test_lifecycle_hooks_fire_in_order(tiny_model_dir, task, tmp_path, plugins, make_plugin):
    events = []
    plugins.register(make_plugin(
        "recorder",
        on_run_start=lambda run: events.append(("start", run.total_steps, len(run.plugins) == 16)),
        on_rollout_end=lambda run, step, trajectories: events.append(("rollout", step, len(trajectories))),
        on_rewards=lambda run, step, rewards, trajectories: events.append(("rewards", step, tuple(rewards.shape))),
        on_step_end=lambda run, step, metrics: events.append(("step", step, "reward/mean" in metrics)),
        on_checkpoint=lambda run, step, path: events.append(("checkpoint", step, path.name)),
        on_run_end=lambda run, status: events.append(("end", status)),
    ))
    train(small_config(tiny_model_dir, task, tmp_path / "run", save_every=1), plugins=plugins)
    assert events == [
        ("start", 2, True),  # the plugin fingerprint's hash
        ("rollout", 0, 4), ("rewards", 0, (4,)), ("step", 0, True), ("checkpoint", 1, "step_1"),
        ("rollout", 1, 4), ("rewards", 1, (4,)), ("step", 1, True), ("checkpoint", 2, "step_2"),
        ("end", "completed"),
    ]


@pytest.mark.run
def test_no_progress_prints_no_progress(tiny_model_dir, task, tmp_path, plugins, capsys):
    train(small_config(tiny_model_dir, task, tmp_path / "quiet", steps=1), plugins=plugins)  # progress=False
    assert "step 1/1" not in capsys.readouterr().err
    train(small_config(tiny_model_dir, task, tmp_path / "loud", steps=1, progress=True), plugins=plugins)
    assert "step 1/1" in capsys.readouterr().err


@pytest.mark.run
def test_reward_edits_in_on_rewards_reach_the_loss(tiny_model_dir, task, tmp_path, plugins, make_plugin):
    def zero_all(rewards):
        rewards.zero_()

    plugins.register(make_plugin("zeroer", on_rewards=zero_all))
    train(small_config(tiny_model_dir, task, tmp_path / "run", steps=1), plugins=plugins)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert metrics["reward/mean"] == 0.0 and metrics["policy/loss"] == 0.0  # GRPO advantages all 0


@pytest.mark.run
def test_on_rewards_sees_0_for_a_sample_whose_reward_was_skipped(tiny_model_dir, task, tmp_path, plugins,
                                                                make_plugin):
    (tmp_path / "half.py").write_text("def reward_func(completions, **kwargs):\n"
                                      "    return [None if i % 2 else 0.5 for i in range(len(completions))]\n")
    seen = []
    plugins.register(make_plugin("watcher", on_rewards=lambda trajectories, rewards: seen.append(
        ([t.reward for t in trajectories], rewards.tolist()))))
    train(small_config(tiny_model_dir, task, tmp_path / "run", steps=1, reward=[str(tmp_path / "half.py")]),
          plugins=plugins)
    (scores, rewards), = seen
    assert None in scores and rewards == [0.0 if score is None else score for score in scores]


@pytest.mark.run
def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, task, tmp_path, make_plugin):
    # a fixed thread count: the default follows the machine's load, and float sums depend on it; an adaptive β, so
    # the KL controller's state must come back too
    adaptive = {"kl_target": 1e-4, "kl_horizon": 4}
    straight = tmp_path / "straight"
    train(small_config(tiny_model_dir, task, straight, steps=4, save_every=2, threads=1, **adaptive),
          plugins=build_plugin_manager())

    def crash(step):
        if step == 2:
            raise KeyboardInterrupt  # as if the job were killed after step 3, its rows logged, its checkpoint not

    interrupted = tmp_path / "interrupted"
    plugins = build_plugin_manager()
    plugins.register(make_plugin("killer", on_step_end=rlhf.hookimpl(trylast=True)(crash)))  # after the loggers
    with pytest.raises(KeyboardInterrupt):
        train(small_config(tiny_model_dir, task, interrupted, steps=4, save_every=2, threads=1, **adaptive),
              plugins=plugins)
    assert not (interrupted / "final").exists()
    assert [m["step"] for m in read_jsonl(interrupted / "metrics.jsonl")] == [1, 2, 3]
    train(small_config(tiny_model_dir, task, interrupted, steps=4, save_every=2, resume=True, threads=1,
                       **adaptive),
          plugins=build_plugin_manager())

    keys = ("reward/mean", "policy/loss", "policy/grad_norm", "response/length_mean", "kl/beta")
    expected = [{k: m[k] for k in keys} for m in read_jsonl(straight / "metrics.jsonl")]
    assert len({m["kl/beta"] for m in expected}) == 4  # β moved at every step
    resumed = [{k: m[k] for k in keys} for m in read_jsonl(interrupted / "metrics.jsonl")]
    assert resumed == expected  # steps 1-2 before the crash, 3-4 after the resume: step 3's first rows were cut
    samples = lambda out: [(s["step"], s["completion"]) for s in read_jsonl(out / "samples.jsonl")]  # noqa: E731
    assert samples(interrupted) == samples(straight)
    for (name, a), b in zip(final_weights(straight).items(), final_weights(interrupted).values()):
        assert torch.equal(a, b), name


@pytest.mark.run
def test_ppo_trains_a_critic_and_kl_goes_into_the_reward(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, algo="ppo", n_samples=1, prompts_per_step=4, critic_lr=1e-3),
          plugins=plugins)
    metrics = read_jsonl(out / "metrics.jsonl")
    for key in ("critic/loss", "critic/values", "critic/clip_frac", "critic/grad_norm", "kl/mean"):
        assert key in metrics[-1], key
    assert (out / "checkpoints" / "step_2" / "critic" / "state.pt").is_file()


@pytest.mark.run
def test_nonfinite_losses_are_skipped_then_stop_the_run(tiny_model_dir, task, tmp_path, plugins, make_plugin):
    def nan_loss(inputs, config):
        return inputs.logprobs * float("nan"), {}

    plugins.register(make_plugin("nan", register_policy_losses=lambda register: register("nan_loss", nan_loss)))
    config = small_config(tiny_model_dir, task, tmp_path / "run", steps=5, policy_loss="nan_loss",
                          max_nonfinite_steps=2)
    with pytest.raises(RlhfError, match="NaN/inf for 2 optimizer steps in a row"):
        train(config, plugins=plugins)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 1 and metrics[0]["policy/skipped_steps"] == 1.0  # the first was skipped and logged


@pytest.mark.unit
def test_grpo_with_one_sample_per_prompt_is_a_usage_error(tiny_model_dir, task, tmp_path, plugins):
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--reward", str(task / "rewards.py"), "--n-samples", "1", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "'grpo' compares samples of the same prompt: set --n-samples to 2 or more (got 1)" in result.output


@pytest.mark.unit
def test_unknown_algorithm_lists_the_presets(plugins):
    result = run_cli(plugins, ["train", "--algo", "gpro", "--model", "m", "--data", "d"])
    assert result.exit_code == 2
    assert "Did you mean 'grpo'" in result.output and "dr_grpo" in result.output


@pytest.mark.unit
def test_existing_run_directory_is_not_overwritten(tiny_model_dir, task, tmp_path, plugins):
    (tmp_path / "run").mkdir()
    for name in ("config.yaml", "plugins.json"):  # a run's (written before run manifests existed)
        (tmp_path / "run" / name).write_text("{}\n")
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RlhfError, match="already holds a run: pass --resume"):
        train(small_config(tiny_model_dir, task, tmp_path / "run"), plugins=plugins)


@pytest.mark.run
def test_mismatch_correction_uses_the_engines_logprobs(tiny_model_dir, task, tmp_path, plugins):
    """With the in-process engine the rollout and trainer log-probs agree, so TIS weights are 1."""
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, algo_config=["correction=tis"]), plugins=plugins)
    metrics = read_jsonl(out / "metrics.jsonl")[-1]
    assert metrics["policy/correction_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert abs(metrics["policy/mismatch_kl"]) < 1e-3


@pytest.mark.run
def test_tensorboard_gets_every_step_and_threads_sets_torchs_thread_count(tiny_model_dir, task, tmp_path, plugins,
                                                                            make_plugin):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = []
    plugins.register(make_plugin("threads", on_run_start=lambda run: seen.append(torch.get_num_threads())))
    before = torch.get_num_threads()
    try:
        train(small_config(tiny_model_dir, task, tmp_path / "run", tensorboard=True, threads=1), plugins=plugins)
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    expected = [(m["step"], m["reward/mean"]) for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert [s for s, _ in logged] == [1, 2]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected])


@pytest.mark.unit
def test_threads_below_one_is_a_config_error(tiny_model_dir, task, tmp_path, plugins):
    from rlhf.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--threads"):
        train(small_config(tiny_model_dir, task, tmp_path / "run", threads=0), plugins=plugins)


@pytest.mark.unit
def test_engine_config_reaches_the_engine_and_unknown_keys_are_refused(tiny_model_dir, task, tmp_path, plugins):
    from rlhf.core.errors import ConfigError
    from rlhf.runtime.rl.local import build_workers
    from rlhf.runtime.config.train_plan import RunPlan

    config = small_config(tiny_model_dir, task, tmp_path / "run", engine_config=["decoder=generate",
                                                                                  "generation_batch_size=3"])
    workers, _ = build_workers(RunPlan.make(config, plugins), plugins)
    assert workers.rollout.engine.config.decoder == "generate"
    assert workers.rollout.engine.config.generation_batch_size == 3
    config = small_config(tiny_model_dir, task, tmp_path / "run", engine_config=["decodr=generate"])
    with pytest.raises(ConfigError, match=r"the 'hf' rollout engine has no option decodr \(--engine.decodr\); "
                                          r"its options: generation_batch_size, decoder"):
        RunPlan.make(config, plugins)
