"""Component settings: each component's config class gets its own namespaced flags, run values
reach only the fields that declare them, and the old flat flags stay as aliases."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
import yaml

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.settings import build_component_config, coerce, run_field, setting_fields
from rlhf.core.types import AdvantageConfig
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.config.train_plan import RunPlan
from tests.helpers import run_cli


@dataclass(kw_only=True)
class ScaledConfig(AdvantageConfig):
    scale: float = field(default=1.0, metadata={"help": "multiply the advantages"})
    seed: int = field(default=0, metadata={"help": "a setting that happens to share the run's flag name"})
    lr: float = field(default=0.5, metadata={"help": "likewise"})
    budget: int = run_field("max_new_tokens", 0, "the run's generation budget")


SEEN: list[ScaledConfig] = []


def scaled(inputs, config):
    """grpo, scaled."""
    from rlhf.algorithms import compute_advantages

    SEEN.append(config)
    advantages, returns = compute_advantages("grpo", rewards=inputs.rewards, action_mask=inputs.action_mask,
                                             group_size=inputs.group_size)
    return advantages * config.scale, returns


@pytest.fixture
def with_scaled(plugins, make_plugin):
    SEEN.clear()
    plugins.register(make_plugin("scaled_plugin", register_advantage_estimators=lambda register: register(
        "scaled", scaled, config_cls=ScaledConfig, needs_groups=True)))
    return plugins


@pytest.mark.unit
def test_run_values_reach_only_fields_that_declare_them():
    config = build_component_config(ScaledConfig, settings={"scale": "2"}, run_values={"seed": 7, "lr": 1.0,
                                                                                       "max_new_tokens": 16},
                                    who="the 'scaled' estimator", flag="--advantage")
    assert (config.scale, config.seed, config.lr, config.budget) == (2.0, 0, 0.5, 16)
    assert [f.name for f in setting_fields(ScaledConfig)] == ["gamma", "lambd", "std_norm", "reward_clip", "scale",
                                                             "seed", "lr"]


@pytest.mark.unit
def test_a_setting_the_component_lacks_or_that_the_run_owns_is_refused():
    with pytest.raises(ConfigError, match=r"the 'scaled' estimator has no option scal \(--advantage.scal\); its "
                                          r"options: gamma, lambd, std_norm, reward_clip, scale, seed, lr"):
        build_component_config(ScaledConfig, settings={"scal": 1}, run_values={}, who="the 'scaled' estimator",
                               flag="--advantage")
    with pytest.raises(ConfigError, match=r"receives budget from the run \(generation budget per completion"):
        build_component_config(ScaledConfig, settings={"budget": 3}, run_values={}, who="the 'scaled' estimator",
                               flag="--advantage")


@pytest.mark.unit
def test_values_are_converted_to_the_annotated_type():
    assert coerce("0.8,0.9", tuple[float, float], "x") == (0.8, 0.9)
    assert coerce(["0.8", 0.9], tuple[float, float], "x") == (0.8, 0.9)
    assert coerce("no", bool, "x") is False and coerce("null", float | None, "x") is None
    assert coerce(["q_proj,v_proj", "o_proj"], list[str], "x") == ["q_proj", "v_proj", "o_proj"]
    with pytest.raises(ConfigError, match=r"--backend.adam-betas: expected 2 values separated by commas"):
        coerce("0.9", tuple[float, float], "--backend.adam-betas")
    with pytest.raises(ConfigError, match=r"--x: expected an integer, got 1.5"):
        coerce(1.5, int, "--x")


@pytest.mark.unit
def test_old_flat_names_and_dotted_keys_fill_the_components():
    config = TrainConfig.from_dict({"model": "m", "data": ["d"], "zero_stage": 3, "clip_high": 0.28,
                                    "backend.weight_decay": 0.1, "components": {"model_adapter": {"lora_rank": 4}}})
    assert config.components == {"model_adapter": {"lora_rank": 4}, "backend": {"zero_stage": 3, "weight_decay": 0.1},
                                 "policy_loss": {"clip_high": 0.28}}
    with pytest.raises(ConfigError, match=r"--backend.zero-stage is given twice, as 3 and 2"):
        TrainConfig.from_dict({"model": "m", "data": ["d"], "zero_stage": 3, "backend.zero_stage": 2})


@pytest.mark.unit
def test_algo_config_finds_the_component_with_that_option(plugins):
    base = TrainConfig(model="m", data=["d"], algo="ppo")
    plan = RunPlan.make(dataclasses.replace(base, algo_config=["clip_high=0.3", "lambd=0.9"]), plugins)
    assert plan.policy_loss_config.clip_high == 0.3 and plan.advantage_config.lambd == 0.9
    with pytest.raises(ConfigError, match=r"--algo-config clip_hi: none of the run's .* has an option clip_hi; "
                                          r"their options: .*clip_high"):
        RunPlan.make(dataclasses.replace(base, algo_config=["clip_hi=0.3"]), plugins)
    with pytest.raises(ConfigError, match=r"--algo-config clip_high: .*already 0.2"):
        RunPlan.make(dataclasses.replace(base, algo_config=["clip_high=0.3"], components={
            "policy_loss": {"clip_high": 0.2}}), plugins)


@pytest.mark.unit
def test_a_setting_for_a_component_without_options_is_an_error(plugins):
    config = TrainConfig(model="m", data=["d"], components={"kl_estimator": {"scale": 2}})
    with pytest.raises(ConfigError, match=r"the 'k3' kl estimator has no option scale \(--kl-estimator.scale\); its "
                                          r"options: none"):
        RunPlan.make(config, plugins)
    tir = RunPlan.make(TrainConfig(model="m", data=["d"], env="tir", components={"env": {"timeout_s": 9}}), plugins)
    assert tir.component_config("env").timeout_s == 9.0


@pytest.mark.unit
def test_an_option_two_components_have_must_be_named_with_its_slot(plugins, make_plugin):
    @dataclass(kw_only=True)
    class ClippedConfig(AdvantageConfig):
        clip_low: float = field(default=0.1, metadata={"help": "an estimator option sharing the ppo loss's name"})

    plugins.register(make_plugin("clipped", register_advantage_estimators=lambda register: register(
        "clipped", scaled, config_cls=ClippedConfig)))
    base = TrainConfig(model="m", data=["d"], advantage="clipped", algo_config=["clip_low=0.3"])
    with pytest.raises(ConfigError, match=r"--algo-config clip_low: several components have an option clip_low; use "
                                          r"--policy-loss.clip-low or --advantage.clip-low"):
        RunPlan.make(base, plugins)
    plan = RunPlan.make(dataclasses.replace(base, algo_config=[], components={"advantage": {"clip_low": 0.3}}), plugins)
    assert plan.advantage_config.clip_low == 0.3 and plan.policy_loss_config.clip_low == 0.2


@pytest.mark.unit
def test_environment_options_reach_the_environment(plugins):
    from rlhf.runtime.rl.rollout import EnvFactory

    plan = RunPlan.make(TrainConfig(model="m", data=["d"], reward=["exact_match"], env="tir",
                                    components={"env": {"timeout_s": 9}}), plugins)
    envs = EnvFactory(plugins.registry("env"), plan.env_settings, plan.run_values())
    assert envs("tir").env.config.timeout_s == 9.0
    routed = RunPlan.make(TrainConfig(model="m", data=["d"], reward=["exact_match"],
                                      components={"env": {"timeout_s": 7}}), plugins)  # --env single_turn
    envs = EnvFactory(plugins.registry("env"), routed.env_settings, routed.run_values())
    assert envs("tir").env.config.timeout_s == 7.0 and envs.capabilities("tir")["multi_turn"]
    resolved = routed.resolved_settings()  # what config.yaml records
    assert resolved["env"] == {"timeout_s": 7} and resolved["kl_estimator"] == {}


@pytest.mark.unit
def test_a_setting_for_another_backend_is_an_error_before_any_model_loads(plugins):
    config = TrainConfig(model="missing-model", data=["d"], components={"backend": {"zero_stage": 3}})
    with pytest.raises(ConfigError, match=r"the 'torch' train backend has no option zero_stage \(--backend.zero-stage\)"):
        RunPlan.make(config, plugins)


@pytest.mark.run
def test_namespaced_and_alias_flags_reach_the_component(tiny_model_dir, task, tmp_path, with_scaled):
    """A third-party estimator's config gets flags of its own; the run's --seed and --lr never reach its
    fields of the same names; its run field gets the run's --max-new-tokens."""
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--reward",
            str(task / "rewards.py"), "--advantage", "scaled", "--advantage.scale", "2.5", "--gamma", "1.0",
            "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "3", "--steps", "1", "--seed", "5",
            "--lr", "1e-3", "--backend.adam-betas", "0.8,0.9", "--weight-decay", "0.01", "--no-progress",
            "--out", str(out)]
    result = run_cli(with_scaled, args)
    assert result.exit_code == 0, result.output
    assert [(c.scale, c.seed, c.lr, c.budget) for c in SEEN] == [(2.5, 0, 0.5, 3)]
    saved = yaml.safe_load((out / "config.yaml").read_text())["components"]
    assert saved["advantage"] == {"gamma": 1.0, "lambd": 1.0, "std_norm": True, "reward_clip": 10.0, "scale": 2.5,
                                  "seed": 0, "lr": 0.5}
    assert saved["backend"]["adam_betas"] == [0.8, 0.9] and saved["backend"]["weight_decay"] == 0.01
    assert "lr" not in saved["backend"] and "total_steps" not in saved["backend"]  # the run's, not settings


@pytest.mark.run
def test_a_run_config_file_reruns_with_the_same_component_settings(tiny_model_dir, task, tmp_path, with_scaled):
    first = tmp_path / "first"
    run_cli(with_scaled, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--reward",
                          str(task / "rewards.py"), "--advantage", "scaled", "--advantage.scale", "2.5",
                          "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "3", "--steps", "1",
                          "--no-progress", "--out", str(first)])
    SEEN.clear()
    second = tmp_path / "second"
    result = run_cli(with_scaled, ["train", "--config", str(first / "config.yaml"), "--out", str(second),
                                   "--zero-stage", "1"])
    assert result.exit_code == 2 and "the 'torch' train backend has no option zero_stage" in result.output
    result = run_cli(with_scaled, ["train", "--config", str(first / "config.yaml"), "--out", str(second)])
    assert result.exit_code == 0, result.output
    assert [c.scale for c in SEEN] == [2.5]
    assert yaml.safe_load((second / "config.yaml").read_text())["components"] == \
        yaml.safe_load((first / "config.yaml").read_text())["components"]
    assert json.loads((second / "plugins.json").read_text())["fingerprint"]


@pytest.mark.run
def test_the_legacy_flat_keys_of_an_older_config_file_still_load(tiny_model_dir, task, tmp_path, plugins):
    old = {"model": str(tiny_model_dir), "data": [str(task / "data.jsonl")], "reward": [str(task / "rewards.py")],
           "clip_high": 0.28, "lora_rank": 2, "adam_betas": "0.9,0.95", "steps": 1, "n_samples": 2,
           "prompts_per_step": 2, "max_new_tokens": 2, "progress": False}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    result = run_cli(plugins, ["train", "--config", str(tmp_path / "old.yaml"), "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["components"]
    assert saved["policy_loss"]["clip_high"] == 0.28 and saved["model_adapter"]["lora_rank"] == 2


@pytest.mark.unit
def test_options_that_would_do_nothing_are_warned_about(plugins, caplog, tmp_path):
    import logging

    from rlhf.runtime.run.lifecycle import start_run

    def start(**options):
        config = TrainConfig(model="m", data=["d"], reward=["exact_match"], out=str(tmp_path / "run"), **options)
        start_run(RunPlan.make(config, plugins), plugins, world_size=1, threads=False).release()

    with caplog.at_level(logging.WARNING):
        start(algo="grpo", save_critic=True)
    assert "--save-critic: algorithm 'grpo' trains no critic" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        start(algo="ppo", save_critic=True)
        start(algo="grpo")
    assert caplog.text == ""


@pytest.mark.unit
def test_the_algorithm_overrides_reach_the_plan(plugins):
    config = TrainConfig(model="m", data=["d"], algo="grpo", advantage="rloo", policy_loss="ppo", kl_estimator="k2",
                         kl_in="reward", kl_coef=0.2, loss_agg="seq_mean_token_mean", n_samples=4)
    algo = RunPlan.make(config, plugins).algorithm
    assert algo.names() == {"algo": "grpo", "advantage": "rloo", "policy_loss": "ppo", "kl_estimator": "k2",
                            "kl_in": "reward", "kl_coef": 0.2, "loss_agg": "seq_mean_token_mean"}


@pytest.mark.unit
def test_the_token_budget_per_trajectory(plugins):
    plan = RunPlan.make(TrainConfig(model="m", data=["d"], max_prompt_length=100, max_turns=3, max_new_tokens=20), plugins)
    assert plan.token_budget == 100 + 3 * 20 and plan.run_values()["max_total_tokens"] == 160
    plan = RunPlan.make(TrainConfig(model="m", data=["d"], max_total_tokens=77), plugins)
    assert plan.token_budget == 77


@pytest.mark.unit
def test_one_pass_over_the_data_by_default(plugins):
    plan = RunPlan.make(TrainConfig(model="m", data=["d"], prompts_per_step=8), plugins)
    assert [plan.total_steps(n) for n in (3, 8, 12, 24)] == [1, 1, 1, 3]
    assert plan.with_prompts(24).optimizer_steps == 3
    plan = RunPlan.make(TrainConfig(model="m", data=["d"], steps=5, ppo_epochs=2, train_batch_size=32), plugins)
    assert plan.total_steps(1000) == 5 and plan.with_prompts(1000).optimizer_steps == 5 * 2 * 2  # 64 / 32 per epoch


@pytest.mark.unit
def test_a_run_needs_a_reward_unless_its_environment_gives_them(plugins):
    with pytest.raises(ConfigError, match=r"--reward is required .* the 'single_turn' environment gives no rewards"):
        RunPlan.make(TrainConfig(model="m", data=["d"]), plugins).check(world_size=1)
    RunPlan.make(TrainConfig(model="m", data=["d"], reward=["exact_match"]), plugins).check(world_size=1)
    rewarding = "tests.helpers:RewardingEnv"
    RunPlan.make(TrainConfig(model="m", data=["d"], env=rewarding), plugins).check(world_size=1)
    with pytest.raises(ConfigError, match=r"--prompts-per-step \(8\) must be a multiple of the number of processes"):
        RunPlan.make(TrainConfig(model="m", data=["d"], reward=["exact_match"]), plugins).check(world_size=3)


@pytest.mark.unit
def test_the_engine_is_asked_for_logprobs_only_when_the_loss_reads_them(plugins, make_plugin):
    base = TrainConfig(model="m", data=["d"])
    assert not RunPlan.make(base, plugins).rollout_logprobs
    assert RunPlan.make(dataclasses.replace(base, algo_config=["correction=tis"]), plugins).rollout_logprobs

    def reads_them(inputs, config):
        return inputs.logprobs * 0, {}

    plugins.register(make_plugin("readers", register_policy_losses=lambda register: (
        register("reads", reads_them, needs_rollout_logprobs=True), register("ignores", reads_them))))
    assert RunPlan.make(dataclasses.replace(base, policy_loss="reads"), plugins).rollout_logprobs
    assert not RunPlan.make(dataclasses.replace(base, policy_loss="ignores"), plugins).rollout_logprobs


@pytest.mark.run
def test_reward_names_resolve_in_the_runs_own_plugin_set(tiny_model_dir, task, tmp_path, plugins, make_plugin):
    def shorter(completions):
        """1 for a short completion."""
        return [1.0 if len(c) < 5 else 0.0 for c in completions]

    plugins.register(make_plugin("only_here", register_rewards=lambda register: register("shorter", shorter)))
    config = TrainConfig(model=str(tiny_model_dir), data=[str(task / "data.jsonl")], reward=["shorter"], steps=1,
                         prompts_per_step=2, n_samples=2, max_new_tokens=2, progress=False, out=str(tmp_path / "run"))
    from rlhf.runtime.rl.local import train

    out = train(config, plugins=plugins)
    assert "reward/shorter" in json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.unit
@pytest.mark.parametrize("target, horizon", [(0.01, 0), (0.01, -5), (0.0, 40), (-1.0, 40)])
def test_adaptive_kl_needs_a_positive_target_and_horizon(target, horizon):
    config = TrainConfig(model="m", data=["d"], reward=["exact_match"], kl_target=target, kl_horizon=horizon)
    with pytest.raises(ConfigError, match="--kl-target and --kl-horizon must be positive"):
        config.derived()
    TrainConfig(model="m", data=["d"], reward=["exact_match"], kl_target=0.01, kl_horizon=1).derived()


@pytest.mark.unit
def test_an_unknown_runtime_is_a_usage_error_naming_the_choices(plugins):
    result = run_cli(plugins, ["train", "--model", "m", "--data", "d.jsonl", "--reward", "r.py", "--runtime", "rey"])
    assert result.exit_code == 2, result.output
    assert "rey" in result.output and "'local'" in result.output and "'ray'" in result.output
