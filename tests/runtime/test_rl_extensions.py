"""The RL loop's extensions end to end on the tiny model: dynamic filtering, eval with
--save-best, critic warm-up, adaptive KL, length shapings, per-source rewards for estimators."""

from __future__ import annotations

import json
import math

import pytest
import torch

import rlhf
from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.local import train
from tests.helpers import read_jsonl, run_cli, small_config, torchrun

# Groups of prompts with an even answer all score 1: no variance, nothing for GRPO to learn.
HALF_CONSTANT = """
def reward_func(completions, answer, **kwargs):
    return [1.0 if int(a) % 2 == 0 else len(c) / 10 for c, a in zip(completions, answer)]
"""

# Rewards always vary, but the OpenRLHF `scores` are constant for even answers.
SCORED = """
def reward_func(completions, answer, **kwargs):
    rewards = [len(c) / 10 for c in completions]
    scores = [1.0 if int(a) % 2 == 0 else r for r, a in zip(rewards, answer)]
    return {"rewards": rewards, "scores": scores}
"""


def _reward_file(tmp_path, source, name="reward.py"):
    path = tmp_path / name
    path.write_text(source)
    return str(path)


@pytest.mark.run
@pytest.mark.parametrize("source", [HALF_CONSTANT, SCORED], ids=["rewards", "scores"])
def test_filter_trains_on_prompts_per_step_groups_that_vary(tiny_model_dir, task, tmp_path, make_plugin, source):
    seen = []
    plugins = build_plugin_manager()
    plugins.register(make_plugin("watcher", on_rewards=lambda trajectories: seen.append(
        [t.columns["answer"] for t in trajectories])))
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, reward=[_reward_file(tmp_path, source)], prompts_per_step=4,
                       n_samples=3, micro_batch_size=4, max_new_tokens=6, filter_groups=True, max_filter_rounds=10,
                       temperature=2.0), plugins=plugins)
    for answers in seen:  # every step trained on exactly 4 groups of 3, none with an even answer
        assert len(answers) == 12 and all(int(a) % 2 == 1 for a in answers)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["filter/kept_groups"] == 4 for m in metrics)
    assert sum(m["filter/dropped_groups"] for m in metrics) > 0
    assert all(m["filter/rounds"] >= 1 and 0 < m["filter/pass_rate"] <= 1 for m in metrics)


@pytest.mark.run
def test_filter_that_keeps_nothing_warns_and_trains_on_the_last_round(tiny_model_dir, task, tmp_path, caplog):
    out = tmp_path / "run"
    constant = _reward_file(tmp_path, "def reward_func(completions, **kwargs):\n    return [1.0 for _ in completions]\n")
    train(small_config(tiny_model_dir, task, out, reward=[constant], steps=1, filter_groups=True, max_filter_rounds=2),
          plugins=build_plugin_manager())
    metrics = read_jsonl(out / "metrics.jsonl")[0]
    assert metrics["filter/rounds"] == 2 and metrics["filter/dropped_groups"] == 4
    assert "no prompt group passed the sample filter" in caplog.text


@pytest.mark.run
def test_third_party_sample_filter_by_reference(tiny_model_dir, task, tmp_path):
    filters = tmp_path / "filters.py"
    filters.write_text("def odd(groups, config):\n    return [int(g[0].columns['answer']) % 2 == 1 for g in groups]\n")
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, steps=2, prompts_per_step=2, sample_filter=f"{filters}:odd",
                       max_filter_rounds=10), plugins=build_plugin_manager())
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["filter/kept_groups"] == 2 for m in metrics)
    assert sum(m["filter/dropped_groups"] for m in metrics) > 0
    assert all(int(s["label"]) % 2 == 1 for s in read_jsonl(out / "samples.jsonl"))


@pytest.mark.run
def test_eval_runs_at_the_start_every_n_steps_and_at_the_end_and_keeps_the_best(tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    config = dict(steps=5, eval_data=[str(task / "data.jsonl")], eval_every=2, eval_n_samples=2, eval_max_samples=3,
                  save_best="eval/reward/mean", max_new_tokens=6)
    train(small_config(tiny_model_dir, task, out, **config), plugins=build_plugin_manager())
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if "eval/reward/mean" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 5]
    assert all(r["eval/prompts"] == 3 and "eval/pass@2" in r and "eval/response/length_mean" in r for r in evals)
    assert all(r["eval/pass@2"] >= r["eval/pass@1"] for r in evals)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4, 5]

    best = json.loads((out / "best" / "best.json").read_text())
    scores = [r["eval/reward/mean"] for r in evals]
    assert best["value"] == max(scores) and best["step"] == evals[scores.index(max(scores))]["step"]
    # best/ holds the policy of that step: rerun to that step (constant LR: the same first steps)
    if best["step"] > 0:
        again = tmp_path / "again"
        train(small_config(tiny_model_dir, task, again, **{**config, "steps": best["step"]}),
              plugins=build_plugin_manager())
        from transformers import AutoModelForCausalLM

        kept = AutoModelForCausalLM.from_pretrained(out / "best").state_dict()
        reference = AutoModelForCausalLM.from_pretrained(again / "final").state_dict()
        assert all(torch.equal(kept[k], reference[k]) for k in kept)


@pytest.mark.unit
def test_save_best_without_eval_data_is_a_usage_error(tiny_model_dir, task, tmp_path, plugins):
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--reward", str(task / "rewards.py"), "--save-best", "eval/reward/mean"])
    assert result.exit_code == 2 and "--save-best needs --eval-data" in result.output


@pytest.mark.run
def test_a_save_best_typo_stops_before_training_and_the_corrected_rerun_runs(tiny_model_dir, task, tmp_path,
                                                                            plugins):
    """The eval before step 1 finds it (exit 2); its row (step 0) does not make the directory a run."""
    out = tmp_path / "run"

    def train(metric):
        return run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                                 "--eval-data", str(task / "data.jsonl"), "--label-key", "answer", "--reward",
                                 str(task / "rewards.py"), "--n-samples", "2", "--prompts-per-step", "2",
                                 "--max-new-tokens", "2", "--steps", "1", "--save-best", metric, "--out", str(out),
                                 "--no-progress"])

    typo = train("eval/rewrd/mean")
    assert typo.exit_code == 2, typo.output
    assert "--save-best eval/rewrd/mean: the eval reports no eval/rewrd/mean; it reports" in typo.output
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [0] and not (out / "checkpoints").exists()
    fixed = train("eval/reward/mean")
    assert fixed.exit_code == 0, fixed.output
    assert (out / "best" / "best.json").exists()


@pytest.mark.run
def test_critic_warm_up_freezes_the_policy(tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, algo="ppo", freeze_actor_steps=2, steps=2),
          plugins=build_plugin_manager())
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["policy/frozen"] for m in metrics] == [1.0, 1.0]
    assert all("critic/loss" in m and "policy/loss" not in m for m in metrics)
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert all(torch.equal(final[k], initial[k]) for k in initial)

    thawed = tmp_path / "thawed"
    train(small_config(tiny_model_dir, task, thawed, algo="ppo", freeze_actor_steps=1, steps=2),
          plugins=build_plugin_manager())
    assert [m["policy/frozen"] for m in read_jsonl(thawed / "metrics.jsonl")] == [1.0, 0.0]


@pytest.mark.run
def test_adaptive_kl_moves_beta_by_the_controller_rule(tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, algo="ppo", steps=3, kl_coef=0.1, kl_target=1e-6, kl_horizon=40),
          plugins=build_plugin_manager())
    betas = [m["kl/beta"] for m in read_jsonl(out / "metrics.jsonl")]
    assert betas[0] == 0.1
    # step 1 samples from the reference itself: KL 0 < target, the error clips at -0.2, β shrinks by
    # 1 - 0.2 · 4 samples / 40; afterwards KL is far above the tiny target: β grows by 1 + 0.2 · 4 / 40
    assert betas[1] == pytest.approx(0.1 * 0.98)
    assert betas[2] == pytest.approx(betas[1] * 1.02)


@pytest.mark.run
def test_length_shapings_change_the_reward_the_loss_sees(tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, steps=1, max_new_tokens=4, overlong_buffer=2,
                       overlong_penalty_factor=0.5, truncated_reward=0.5, temperature=2.0),
          plugins=build_plugin_manager())
    metrics = read_jsonl(out / "metrics.jsonl")[0]
    assert {"overlong/penalized", "overlong/penalty_mean", "truncated/count", "truncated/rate"} <= set(metrics)
    for sample in read_jsonl(out / "samples.jsonl"):
        raw = sample["rewards"]["reward_func"]
        tokens = sample["completion_tokens"]
        expected = raw - 0.5 * max(0, min(tokens - 2, 2)) / 2
        if sample["finish_reason"] == "length":
            expected *= 0.5
        assert sample["reward"] == pytest.approx(expected)


@pytest.mark.run
def test_estimator_sees_each_sources_rewards_and_row_metadata(tiny_model_dir, task, tmp_path, make_plugin):
    """A GDPO-style estimator: each source normalised within its group on its own, then summed."""
    received = []

    def per_source_grpo(inputs, config):
        received.append((sorted(inputs.source_rewards), [row["answer"] for row in inputs.metadata]))
        n = inputs.group_size
        total = torch.zeros_like(inputs.rewards)
        for rewards in inputs.source_rewards.values():
            groups = rewards.view(-1, n)
            total += ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1)
        advantages = total[:, None] * inputs.action_mask
        return advantages, advantages

    plugins = build_plugin_manager()
    plugins.register(make_plugin("gdpo", register_advantage_estimators=lambda register: register(
        "per_source_grpo", per_source_grpo, needs_groups=True)))
    length = _reward_file(tmp_path, "def length(completions, **kw):\n    return [len(c) / 10 for c in completions]\n",
                          "length.py")
    parity = _reward_file(tmp_path, "def parity(completions, **kw):\n    return [len(c) % 2 for c in completions]\n",
                          "parity.py")
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, steps=1, advantage="per_source_grpo", n_samples=3,
                       reward=[f"{length}:length", f"{parity}:parity@0.5"]), plugins=plugins)
    (names, answers), = received
    assert {"length", "parity"} <= set(names) and len(answers) == 6 and all(a.isdigit() for a in answers)


@pytest.mark.run
def test_unbiased_gradient_needs_kl_in_the_loss(tiny_model_dir, task, tmp_path):
    with pytest.raises(RlhfError, match="--kl-unbiased-gradient"):
        train(small_config(tiny_model_dir, task, tmp_path / "run", algo="ppo", kl_unbiased_gradient=True),
              plugins=build_plugin_manager())
    # Step 1 samples from the reference itself: δ = 0 on every token. k1's own gradient is β per token,
    # the unbiased one w·δ = 0: with the flag the step's gradient is the policy loss's alone.
    norms = {}
    for name, options in (("unbiased", dict(kl_unbiased_gradient=True)), ("k1", {}), ("no_kl", dict(kl_in="none"))):
        out = tmp_path / name
        train(small_config(tiny_model_dir, task, out, steps=1, kl_estimator="k1", kl_coef=0.1, **options),
              plugins=build_plugin_manager())
        norms[name] = read_jsonl(out / "metrics.jsonl")[0]["policy/grad_norm"]
    assert norms["unbiased"] == pytest.approx(norms["no_kl"], rel=1e-5)
    assert norms["k1"] != pytest.approx(norms["no_kl"], rel=1e-3)


@pytest.mark.run
def test_gspo_and_seq_mask_tis_train_through_the_cli(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--reward", str(task / "rewards.py"), "--policy-loss", "gspo", "--algo-config",
                               "correction=seq_mask_tis", "--prompts-per-step", "2", "--n-samples", "2",
                               "--max-new-tokens", "4", "--steps", "1", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(out / "metrics.jsonl")[0]
    assert "policy/clip_frac" in metrics and "policy/mismatch_kl" in metrics


@pytest.mark.cluster
def test_filtering_and_eval_under_torchrun_with_two_processes(tiny_model_dir, task, tmp_path):

    reward = _reward_file(tmp_path, HALF_CONSTANT)
    out = tmp_path / "run"
    torchrun(2, "-m", "rlhf", "train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
             "--label-key", "answer", "--reward", reward, "--prompts-per-step", "4", "--n-samples", "2",
             "--max-new-tokens", "6", "--micro-batch-size", "2", "--lr", "1e-3", "--temperature", "2.0",
             "--filter-groups", "--max-filter-rounds", "10", "--eval-data", str(task / "data.jsonl"),
             "--eval-max-samples", "4", "--eval-every", "1", "--steps", "2", "--no-progress", "--out", str(out))
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/reward/mean" in r] == [0, 1, 2]  # once, by the main rank
    assert all(r["filter/kept_groups"] == 4 for r in rows if "filter/kept_groups" in r)
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 2 * 4 * 2 and all(int(s["label"]) % 2 == 1 for s in samples)


# --- --save-best with evals the test chooses ------------------------------------------------------

class ScriptedEvalReward:
    """A reward that gives every eval sample the next value of ``script`` (None: no score, so the
    eval's ``eval/reward/mean`` is NaN) and training samples their length / 10. Eval prompts start
    with "EVAL"; an eval is scored in one call."""

    script: list[float | None] = []

    @staticmethod
    def reward(prompts, completions, **kwargs):
        if all(prompt.startswith("EVAL") for prompt in prompts):
            value = ScriptedEvalReward.script.pop(0)
            return [value] * len(completions)
        return [len(c) / 10 for c in completions]


def _scripted_eval_run(tiny_model_dir, task, tmp_path, make_plugin, **overrides):
    """(plugins, config): ``--reward scripted_eval``, eval on two EVAL prompts after every step, best by
    ``eval/reward/mean``."""
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(json.dumps({"prompt": f"EVAL: what is {a} + 1?", "answer": str(a + 1)}) + "\n"
                                 for a in range(2)))
    plugins = build_plugin_manager()
    plugins.register(make_plugin("scripted_eval_reward", register_rewards=lambda register: register(
        "scripted_eval", ScriptedEvalReward.reward)))
    config = dict(reward=["scripted_eval"], eval_data=[str(eval_data)], eval_every=1, save_best="eval/reward/mean",
                  max_new_tokens=3, **overrides)
    return plugins, small_config(tiny_model_dir, task, tmp_path / "run", **config)


@pytest.mark.run
def test_a_nan_eval_is_never_best(tiny_model_dir, task, tmp_path, make_plugin):
    """Evals before step 1 (no score: NaN), after step 1 (1.0) and after step 2 (NaN): no best/ after
    the first, then step 1's policy is best and stays."""
    out = tmp_path / "run"
    best_exists: list[bool] = []
    plugins, config = _scripted_eval_run(tiny_model_dir, task, tmp_path, make_plugin, steps=2)
    plugins.register(make_plugin("look_for_best", on_step_end=lambda step: best_exists.append(
        (out / "best").exists())))  # runs before the eval after that step
    ScriptedEvalReward.script = [None, 1.0, None]
    train(config, plugins=plugins)
    assert ScriptedEvalReward.script == []
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [float(r["eval/reward/mean"]) for r in rows if "eval/reward/mean" in r]  # NaN is written "nan"
    assert len(evals) == 3 and math.isnan(evals[0]) and evals[1] == 1.0 and math.isnan(evals[2])
    assert best_exists == [False, True]
    assert json.loads((out / "best" / "best.json").read_text()) == {"metric": "eval/reward/mean", "value": 1.0,
                                                                    "step": 1}


@pytest.mark.run
def test_resume_keeps_the_best_of_the_interrupted_run(tiny_model_dir, task, tmp_path, make_plugin):
    """Evals 1, 2, 5 (best, after step 2), then killed after step 3, before its eval (the checkpoint is
    step 2's); the resumed run's evals, 0.5 and 3, are worse than 5: best/ keeps step 2's policy."""
    out = tmp_path / "run"

    def kill_after_step_3(step):
        if step == 2:
            raise KeyboardInterrupt

    plugins, config = _scripted_eval_run(tiny_model_dir, task, tmp_path, make_plugin, steps=4, save_every=1)
    plugins.register(make_plugin("killer", on_step_end=rlhf.hookimpl(trylast=True)(kill_after_step_3)))
    ScriptedEvalReward.script = [1.0, 2.0, 5.0]
    with pytest.raises(KeyboardInterrupt):
        train(config, plugins=plugins)
    assert ScriptedEvalReward.script == []
    best_json = (out / "best" / "best.json").read_text()
    assert json.loads(best_json) == {"metric": "eval/reward/mean", "value": 5.0, "step": 2}
    best_weights = (out / "best" / "model.safetensors").read_bytes()

    plugins, config = _scripted_eval_run(tiny_model_dir, task, tmp_path, make_plugin, steps=4, save_every=1,
                                         resume=True)
    ScriptedEvalReward.script = [0.5, 3.0]
    train(config, plugins=plugins)
    assert ScriptedEvalReward.script == []
    evals = {r["step"]: r["eval/reward/mean"] for r in read_jsonl(out / "metrics.jsonl") if "eval/reward/mean" in r}
    assert evals == {0: 1.0, 1: 2.0, 2: 5.0, 3: 0.5, 4: 3.0}
    assert (out / "best" / "best.json").read_text() == best_json
    assert (out / "best" / "model.safetensors").read_bytes() == best_weights
    assert (out / "final" / "model.safetensors").read_bytes() != best_weights  # training went on after step 2


@pytest.mark.unit
def test_the_controllers_kl_leaves_out_skipped_samples():
    """The adaptive β is told the mean over counted samples of each sample's token-mean KL: a sample
    whose reward was skipped (loss mask 0, action mask 1) is not one of them."""
    from types import SimpleNamespace

    from rlhf.runtime.rl.step_metrics import sequence_kl

    kl = torch.tensor([[0.2, 0.4, 0.0], [5.0, 5.0, 5.0], [0.1, 0.1, 0.1]])  # (B, A)
    action_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    loss_mask = action_mask * torch.tensor([[1.0], [0.0], [1.0]])  # the second sample skipped
    batch = SimpleNamespace(kl=kl, action_mask=action_mask, loss_mask=loss_mask)
    assert sequence_kl(batch, {}) == pytest.approx((0.3 + 0.1) / 2)
    assert sequence_kl(SimpleNamespace(kl=None), {"policy/kl": 0.7}) == 0.7


@pytest.mark.unit
def test_eval_pass_at_n_is_the_share_of_prompts_solved_in_n_tries():
    from types import SimpleNamespace

    from rlhf.core.rewards import RewardResult
    from rlhf.runtime.run.evaluation import metrics_of

    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]  # 3 prompts x 2 samples: solved once, never, twice
    trajectories = [SimpleNamespace(num_policy_tokens=4, finish_reason="stop", outcome="ok") for _ in rewards]
    reward = SimpleNamespace(score=lambda t: RewardResult(total=rewards, per_source={}, metrics={}))
    metrics = metrics_of(trajectories, reward.score(trajectories), n_samples=2)
    assert metrics["eval/pass@2"] == pytest.approx(2 / 3)
    assert metrics["eval/pass@1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert metrics["eval/reward/mean"] == pytest.approx(0.5) and metrics["eval/prompts"] == 3
