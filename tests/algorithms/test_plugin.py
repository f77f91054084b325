"""The built-in algorithms plugin through the registries, `resolve_algorithm`'s validation, the
sample mask, and the public API's errors."""

from __future__ import annotations

import json
import math
import warnings
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from rlhf.algorithms import (
    AlgorithmConfigError,
    LoadedComponent,
    aggregate_loss,
    compute_advantages,
    load_component,
    policy_loss,
    resolve_algorithm,
    value_loss,
)
from rlhf.core.errors import PluginError, RlhfError, UnknownComponentError
from rlhf.core.types import AdvantageConfig, AlgorithmPreset
from tests.helpers import run_cli

pytestmark = pytest.mark.unit

ESTIMATOR_FLAGS = {  # name: (needs_critic, needs_groups)
    "gae": (True, False),
    "reinforce_pp": (False, False),
    "reinforce_pp_baseline": (False, True),
    "rloo": (False, True),
    "grpo": (False, True),
    "dr_grpo": (False, True),
}

# docs/algorithms.md's preset table: estimator, KL placement, KL estimator, β, aggregation (, policy loss: ppo).
PRESET_TABLE = {
    "ppo": ("gae", "reward", "k1", 0.01, "token_mean"),
    "reinforce_pp": ("reinforce_pp", "reward", "k1", 0.01, "token_mean"),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", "loss", "k3", 0.001, "token_mean"),
    "rloo": ("rloo", "reward", "k1", 0.01, "token_mean"),
    "grpo": ("grpo", "loss", "k3", 0.001, "token_mean"),
    "dr_grpo": ("dr_grpo", "loss", "k3", 0.001, "seq_mean_token_sum_norm"),
    "cispo": ("grpo", "none", "k3", 0.0, "token_mean", "cispo"),
    "sapo": ("grpo", "none", "k3", 0.0, "seq_mean_token_mean", "sapo"),
    "opd": ("grpo", "none", "k1", 0.0, "token_mean"),  # on-policy distillation: the teacher instead of a KL term
}
LOSS_CONFIGS = {"ppo": "PPOLossConfig", "cispo": "CISPOLossConfig", "sapo": "SAPOLossConfig"}


def test_builtin_names_and_capabilities(plugins):
    registries = plugins.registries()
    assert registries["advantage_estimator"].names() == sorted(ESTIMATOR_FLAGS)
    assert registries["kl_estimator"].names() == ["k1", "k2", "k3"]
    assert registries["policy_loss"].names() == ["cispo", "gspo", "ppo", "sapo"]
    assert registries["loss_aggregation"].names() == sorted(
        ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
    assert registries["algorithm"].names() == sorted(PRESET_TABLE)
    for name, (needs_critic, needs_groups) in ESTIMATOR_FLAGS.items():
        component = registries["advantage_estimator"].component(name)
        assert component.capabilities == {"needs_critic": needs_critic, "needs_groups": needs_groups,
                                          "supports_masking": True, "implements": name}, name  # every built-in masks (outcomes)
        assert component.is_lazy and component.description and component.load_config_cls() is AdvantageConfig
    for registry in registries.values():
        for component in registry.components():
            if component.provider.name == "rlhf.plugins.algorithms.plugin":
                assert component.description, component.name


@pytest.mark.parametrize("algo", sorted(PRESET_TABLE))
def test_presets_follow_the_design_table(plugins, algo):
    estimator, kl_in, kl_estimator, kl_coef, loss_agg, *loss = PRESET_TABLE[algo]
    loss = loss[0] if loss else "ppo"
    resolved = resolve_algorithm(algo, n_samples=4, plugins=plugins)
    assert resolved.names() == {"algo": algo, "advantage": estimator, "policy_loss": loss,
                                "kl_estimator": kl_estimator, "kl_in": kl_in, "kl_coef": kl_coef, "loss_agg": loss_agg}
    assert resolved.needs_critic == (algo == "ppo")
    assert resolved.needs_groups == ESTIMATOR_FLAGS[estimator][1]
    assert resolved.needs_reference == (kl_in != "none")
    assert resolved.needs_teacher == (algo == "opd")
    assert isinstance(resolved.advantage, LoadedComponent) and callable(resolved.advantage.obj)
    registries = plugins.registries()
    assert resolved.advantage_fn is registries["advantage_estimator"].get(estimator)
    assert resolved.advantage_config_cls is AdvantageConfig
    assert resolved.policy_loss_fn is registries["policy_loss"].get(loss)
    assert resolved.policy_loss_config_cls.__name__ == LOSS_CONFIGS[loss]
    assert resolved.kl_estimator_fn is registries["kl_estimator"].get(kl_estimator)
    assert resolved.aggregate_fn is registries["loss_aggregation"].get(loss_agg)


def test_resolve_algorithm_overrides_each_piece(plugins):
    resolved = resolve_algorithm("grpo", advantage="rloo", kl_estimator="k2", kl_coef=0.05, kl_in="reward",
                                 loss_agg="seq_mean_token_mean", n_samples=2, plugins=plugins)
    assert resolved.names() == {"algo": "grpo", "advantage": "rloo", "policy_loss": "ppo", "kl_estimator": "k2",
                                "kl_in": "reward", "kl_coef": 0.05, "loss_agg": "seq_mean_token_mean"}
    # The resolved components go straight back into the functional API, without names.
    advantages, _ = compute_advantages(resolved.advantage, rewards=torch.tensor([1.0, 0.0]),
                                       action_mask=torch.ones(2, 1), group_size=2, plugins=plugins)
    assert advantages.flatten().tolist() == [1.0, -1.0]


@pytest.mark.parametrize("kl_in, kl_coef, needs_reference", [
    ("none", 0.01, False), ("loss", 0.0, False), ("reward", 0.0, False), ("loss", 0.001, True),
])
def test_reference_model_is_needed_only_when_kl_counts(plugins, kl_in, kl_coef, needs_reference):
    resolved = resolve_algorithm("grpo", kl_in=kl_in, kl_coef=kl_coef, n_samples=2, plugins=plugins)
    assert (resolved.kl_in, resolved.needs_reference) == (kl_in, needs_reference)


def test_group_estimator_with_one_sample_is_refused_before_the_run(plugins):
    with pytest.raises(AlgorithmConfigError) as info:
        resolve_algorithm("grpo", n_samples=1, plugins=plugins)
    assert str(info.value) == ("advantage estimator 'grpo' compares samples of the same prompt: set --n-samples "
                               "to 2 or more (got 1)")
    with pytest.raises(AlgorithmConfigError, match="'rloo' compares samples"):
        resolve_algorithm("ppo", advantage="rloo", n_samples=1, plugins=plugins)
    assert resolve_algorithm("reinforce_pp", n_samples=1, plugins=plugins).needs_groups is False
    with pytest.raises(AlgorithmConfigError, match="set --n-samples to 2"):
        compute_advantages("grpo", rewards=torch.ones(3), action_mask=torch.ones(3, 2), group_size=1,
                           plugins=plugins)


@pytest.mark.parametrize("kwargs, message", [
    ({"kl_in": "both"}, "--kl-in must be one of reward, loss, none (got 'both')"),
    ({"kl_coef": -0.1}, "--kl-coef must be a number >= 0"),
    ({"n_samples": 0}, "--n-samples must be a positive integer"),
])
def test_resolve_algorithm_rejects_bad_settings(plugins, kwargs, message):
    with pytest.raises(AlgorithmConfigError) as info:
        resolve_algorithm("grpo", **{"n_samples": 4, **kwargs}, plugins=plugins)
    assert message in str(info.value) and isinstance(info.value, RlhfError)


@pytest.mark.parametrize("kwargs, kind", [
    ({"algo": "gpro"}, "algorithm"), ({"advantage": "rlo"}, "advantage estimator"),
    ({"kl_estimator": "k4"}, "kl estimator"), ({"policy_loss": "ppo2"}, "policy loss"),
    ({"loss_agg": "token_sum"}, "loss aggregation"),
])
def test_unknown_names_get_suggestions(plugins, kwargs, kind):
    with pytest.raises(UnknownComponentError) as info:
        resolve_algorithm(**{"algo": "grpo", "n_samples": 4, **kwargs}, plugins=plugins)
    assert str(info.value).startswith(f"unknown {kind} ") and "Did you mean" in str(info.value)


def test_a_third_party_estimator_is_used_by_name(plugins, make_plugin):
    calls = []

    def constant_advantages(inputs, config):
        """Everyone gets the group size (a test estimator)."""
        calls.append((inputs.group_size, config.gamma, config.reward_clip))
        advantages = inputs.action_mask * float(inputs.group_size)
        return advantages, advantages

    plugins.register(make_plugin("third_party", register_advantage_estimators=lambda register: register(
        "constant", constant_advantages, needs_groups=True)))
    advantages, returns = compute_advantages("constant", rewards=torch.zeros(4), action_mask=torch.ones(4, 2),
                                             group_size=2, gamma=0.5, plugins=plugins)
    assert advantages.tolist() == [[2.0, 2.0]] * 4 and calls == [(2, 0.5, 10.0)]
    resolved = resolve_algorithm("grpo", advantage="constant", n_samples=2, plugins=plugins)
    assert resolved.advantage.obj is constant_advantages and resolved.needs_groups
    with pytest.raises(AlgorithmConfigError, match="'constant' compares samples"):
        resolve_algorithm("grpo", advantage="constant", n_samples=1, plugins=plugins)


def test_a_reference_or_a_function_works_without_registration(plugins):
    advantages, _ = compute_advantages("rlhf.plugins.algorithms.grpo:dr_grpo_advantages",
                                       rewards=torch.tensor([1.0, 0.0]), action_mask=torch.ones(2, 1), group_size=2)
    assert advantages.flatten().tolist() == [0.5, -0.5]

    def halve(loss, loss_mask, norm):
        return (loss * loss_mask).sum() / norm.num_tokens / 2

    loss, _ = policy_loss("ppo", logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2),
                          advantages=torch.ones(1, 2), loss_mask=torch.ones(1, 2), aggregation=halve, plugins=plugins)
    assert loss.item() == -0.5
    with pytest.raises(AlgorithmConfigError, match="not a policy loss"):
        load_component("policy_loss", load_component("kl_estimator", "k1", plugins=plugins))


def test_the_functions_find_components_of_the_plugin_set_they_are_given(plugins, make_plugin):
    """A component only a run's own plugin set has (not the process-wide default one) is found by name."""
    plugins.register(make_plugin("halving", register_loss_aggregations=lambda register: register(
        "halved_token_mean", lambda loss, loss_mask, norm: (loss * loss_mask).sum() / norm.num_tokens / 2)))
    assert aggregate_loss("halved_token_mean", torch.ones(1, 2), torch.ones(1, 2), plugins=plugins).item() == 0.5
    loss, _ = policy_loss("ppo", logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2),
                          advantages=torch.ones(1, 2), loss_mask=torch.ones(1, 2), aggregation="halved_token_mean",
                          plugins=plugins)
    assert loss.item() == -0.5


def test_a_broken_estimator_output_names_the_estimator(plugins, make_plugin):
    plugins.register(make_plugin("broken", register_advantage_estimators=lambda register: register(
        "wrong_shape", lambda inputs, config: (inputs.rewards, inputs.rewards))))
    with pytest.raises(PluginError, match="'wrong_shape' must return"):
        compute_advantages("wrong_shape", rewards=torch.zeros(2), action_mask=torch.ones(2, 3), group_size=1,
                           plugins=plugins)


# --- sample_mask --------------------------------------------------------------------------------

def test_sample_mask_leaves_invalid_samples_out_of_group_statistics(plugins):
    rewards = torch.tensor([1.0, 0.0, float("nan"), 0.0])  # the third reward failed (skip)
    valid = torch.tensor([True, True, False, True])
    mask = torch.ones(4, 2)
    grpo, grpo_returns = compute_advantages("grpo", rewards=rewards, action_mask=mask, group_size=4,
                                            sample_mask=valid, plugins=plugins)
    # valid rewards [1, 0, 0]: mean 1/3, unbiased std sqrt((4/9 + 1/9 + 1/9)/2) = 1/√3
    std = 1 / math.sqrt(3)
    assert grpo[:, 0].tolist() == pytest.approx([(2 / 3) / std, -(1 / 3) / std, 0.0, -(1 / 3) / std], abs=1e-6)
    assert grpo_returns[2].tolist() == [0.0, 0.0]
    rloo, _ = compute_advantages("rloo", rewards=rewards, action_mask=mask, group_size=4, sample_mask=valid,
                                 plugins=plugins)
    assert rloo[:, 0].tolist() == pytest.approx([1.0, -0.5, 0.0, -0.5])  # baselines (0+0)/2, (1+0)/2, (1+0)/2
    dr, _ = compute_advantages("dr_grpo", rewards=rewards, action_mask=mask, group_size=4,
                               sample_mask=valid.float(), plugins=plugins)
    assert dr[:, 0].tolist() == pytest.approx([2 / 3, -1 / 3, 0.0, -1 / 3])


@pytest.mark.parametrize("returned", [
    "a tensor", (torch.zeros(1, 2),), [torch.zeros(1, 2), {}], (torch.zeros(2, 2), {}), ("loss", {}),
])
def test_a_policy_loss_that_returns_the_wrong_thing_is_named(plugins, make_plugin, returned):
    from rlhf.core.errors import PluginError

    plugins.register(make_plugin("bad_loss", register_policy_losses=lambda register: register(
        "bad", lambda inputs, config: returned)))
    with pytest.raises(PluginError, match=r"policy loss 'bad' must return \(per_token_loss, metrics\)"):
        policy_loss("bad", logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2), advantages=torch.ones(1, 2),
                    loss_mask=torch.ones(1, 2), plugins=plugins)


@pytest.mark.parametrize("shape", [(3, 4), (4,), (2, 4, 1)])
def test_advantage_inputs_of_the_wrong_shape_are_refused(plugins, shape):
    with pytest.raises(ValueError, match=r"action_mask must be \(B, A\) with B = 2"):
        compute_advantages("grpo", rewards=torch.ones(2), action_mask=torch.ones(*shape), group_size=2, plugins=plugins)


@pytest.mark.parametrize("algo, kl_in, in_loss", [("grpo", "loss", 0.02), ("grpo", "reward", 0.0), ("ppo", "reward", 0.0),
                                                 ("ppo", "loss", 0.02), ("grpo", "none", 0.0)])
def test_kl_is_in_the_objective_only_when_placed_in_the_loss(plugins, algo, kl_in, in_loss):
    from rlhf.algorithms import resolve_algorithm

    resolved = resolve_algorithm(algo, kl_in=kl_in, kl_coef=0.02, n_samples=2, plugins=plugins)
    assert resolved.policy_training_loss(None).kl_coef == in_loss
    assert resolved.kl_in_reward == (kl_in == "reward") and resolved.kl_in_loss == (kl_in == "loss")


def test_the_objective_refuses_negative_coefficients_and_missing_inputs(plugins):
    from rlhf.algorithms import AlgorithmConfigError, policy_objective

    kwargs = dict(logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2), advantages=torch.ones(1, 2),
                  loss_mask=torch.ones(1, 2), plugins=plugins)
    for bad in ({"kl_coef": -0.1, "ref_logprobs": torch.zeros(1, 2)},
                {"entropy_coef": -0.1, "entropy": torch.ones(1, 2)}):
        with pytest.raises(AlgorithmConfigError, match="must be >= 0"):
            policy_objective("ppo", **kwargs, **bad)
    with pytest.raises(AlgorithmConfigError, match="needs the reference log-probs"):
        policy_objective("ppo", kl_coef=0.1, **kwargs)
    with pytest.raises(AlgorithmConfigError, match="needs the per-token entropy"):
        policy_objective("ppo", entropy_coef=0.1, **kwargs)


def test_a_group_left_with_two_valid_samples_uses_the_n_minus_one_std(plugins):
    rewards = torch.tensor([1.0, 0.0, 7.0])  # the third reward failed (skip)
    valid = torch.tensor([True, True, False])
    grpo, _ = compute_advantages("grpo", rewards=rewards, action_mask=torch.ones(3, 1), group_size=3,
                                 sample_mask=valid, plugins=plugins)
    # valid [1, 0]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 1/√2
    assert grpo[:, 0].tolist() == pytest.approx([0.5 * math.sqrt(2), -0.5 * math.sqrt(2), 0.0], abs=1e-6)


def test_sample_mask_leaves_invalid_samples_out_of_whitening(plugins):
    rewards = torch.tensor([1.0, 0.0, 123.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    advantages, returns = compute_advantages("reinforce_pp", rewards=rewards, action_mask=mask, group_size=1,
                                             sample_mask=torch.tensor([1, 1, 0]), plugins=plugins)
    alone, _ = compute_advantages("reinforce_pp", rewards=rewards[:2], action_mask=mask[:2], group_size=1,
                                  plugins=plugins)
    torch.testing.assert_close(advantages[:2], alone)
    assert advantages[2].tolist() == [0.0, 0.0] and returns[2].tolist() == [0.0, 0.0]
    critic, _ = compute_advantages("gae", rewards=rewards, action_mask=mask, values=torch.ones(3, 2), group_size=1,
                                   sample_mask=torch.tensor([1, 1, 0]), plugins=plugins)
    assert critic[2].tolist() == [0.0, 0.0] and torch.isfinite(critic).all()


def test_a_lone_valid_sample_gets_no_group_advantage(plugins):
    rewards = torch.tensor([1.0, 5.0, 0.0, 1.0])
    valid = torch.tensor([True, False, True, True])  # the first group keeps one sample
    for estimator in ("grpo", "rloo", "dr_grpo"):
        advantages, _ = compute_advantages(estimator, rewards=rewards, action_mask=torch.ones(4, 1), group_size=2,
                                           sample_mask=valid, plugins=plugins)
        assert advantages[:2].flatten().tolist() == [0.0, 0.0], estimator
        assert advantages[2:].flatten().tolist() != [0.0, 0.0], estimator


# --- settings and errors ---------------------------------------------------------------------

def test_group_estimators_use_unit_gamma_and_warn(plugins):
    kwargs = dict(rewards=torch.tensor([1.0, 0.0]), action_mask=torch.ones(2, 3), group_size=2, plugins=plugins)
    with pytest.warns(UserWarning, match="'rloo' compares the samples of a group and always uses gamma = 1"):
        discounted, _ = compute_advantages("rloo", gamma=0.5, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at gamma 1
        undiscounted, _ = compute_advantages("rloo", **kwargs)
    assert torch.equal(discounted, undiscounted)
    _, honoured = compute_advantages("reinforce_pp", gamma=0.5, **kwargs)
    assert honoured[0].tolist() == [0.25, 0.5, 1.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"gamma": 1.5}, "gamma must be in"), ({"lambd": -0.1}, "lambd must be in"),
    ({"reward_clip": 0.0}, "reward_clip must be positive"), ({"kl_coef": -1.0}, "kl_coef"),
])
def test_bad_advantage_settings_are_user_errors(plugins, kwargs, message):
    with pytest.raises(RlhfError, match=message):
        compute_advantages("reinforce_pp", rewards=torch.ones(2), action_mask=torch.ones(2, 2), group_size=1,
                           plugins=plugins, **kwargs)


def test_gae_needs_values(plugins):
    with pytest.raises(AlgorithmConfigError, match="'gae' needs critic values"):
        compute_advantages("gae", rewards=torch.ones(2), action_mask=torch.ones(2, 2), group_size=1, plugins=plugins)


@pytest.mark.parametrize("kwargs, message", [
    ({"dual_clip": 0.9}, "dual_clip must be greater than 1"),
    ({"dual_clip": 1.0}, "dual_clip must be greater than 1"),  # c = 1 would cap a negative-advantage ratio at 1
    ({"correction": "seq-tis"}, "unknown mismatch correction 'seq_tis'"),
    ({"correction": "tis"}, "needs the rollout engine's log-probs"),
    ({"clip_low": 1.5}, "clip ranges"),
    ({"correction_bounds": (5.0, 0.5)}, "correction_bounds"),
])
def test_bad_policy_loss_settings_are_user_errors(plugins, kwargs, message):
    with pytest.raises(RlhfError, match=message):
        policy_loss("ppo", logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2), advantages=torch.ones(1, 2),
                    loss_mask=torch.ones(1, 2), plugins=plugins, **kwargs)


def test_a_setting_the_loss_does_not_have_is_refused(plugins, make_plugin):
    def plain(inputs, config):
        return -inputs.advantages * inputs.logprobs, {}

    plugins.register(make_plugin("plain_loss", register_policy_losses=lambda register: register("plain", plain)))
    kwargs = dict(logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2), advantages=torch.ones(1, 2),
                  loss_mask=torch.ones(1, 2), plugins=plugins)
    assert policy_loss("plain", **kwargs)[0].item() == 0.0
    with pytest.raises(AlgorithmConfigError, match="policy loss 'plain' has no setting dual_clip"):
        policy_loss("plain", dual_clip=2.0, **kwargs)


def test_value_loss_rejects_a_non_positive_clip(plugins):
    with pytest.raises(AlgorithmConfigError, match="value clip must be positive"):
        value_loss(values=torch.zeros(1, 1), old_values=torch.zeros(1, 1), returns=torch.zeros(1, 1),
                   loss_mask=torch.ones(1, 1), clip=0.0, plugins=plugins)


def test_shape_mismatches_are_reported(plugins):
    with pytest.raises(ValueError, match=r"values has shape \(2, 3\), expected \(2, 2\)"):
        compute_advantages("gae", rewards=torch.ones(2), action_mask=torch.ones(2, 2), values=torch.ones(2, 3),
                           group_size=1, plugins=plugins)
    with pytest.raises(ValueError, match="positive divisor of the batch size 3"):
        compute_advantages("reinforce_pp", rewards=torch.ones(3), action_mask=torch.ones(3, 2), group_size=2,
                           plugins=plugins)


# --- laziness and the command line ---------------------------------------------------------------

def test_importing_the_api_builds_nothing_and_imports_no_torch():
    code = ("import json, sys, rlhf.algorithms, rlhf.core.plugin_host.loading as core\n"
            "print(json.dumps([core._installed is None, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [True, False]


def test_plugins_show_prints_flags_and_config(plugins):
    result = run_cli(plugins, ["plugins", "show", "grpo"])
    assert result.exit_code == 0, result.output
    assert "advantage_estimator grpo" in result.output and "needs_groups=True" in result.output
    assert "algorithm grpo" in result.output and "gamma (float, default 1.0)" in result.output
    ppo = run_cli(plugins, ["plugins", "show", "ppo"])
    assert "config (PPOLossConfig)" in ppo.output and "dual_clip" in ppo.output
    # a flag the config decides names its function, not a repr with an address
    assert "needs_rollout_logprobs=set by the config (rlhf.plugins.algorithms.plugin:corrects_mismatch)" in ppo.output
    assert "<function" not in ppo.output


def test_presets_are_algorithm_preset_objects(plugins):
    for name in PRESET_TABLE:
        preset = plugins.registry("algorithm").get(name)
        assert isinstance(preset, AlgorithmPreset) and preset.description


# --- docs/algorithms.md stays true ----------------------------------------------------------------

def _docs_python_blocks() -> list[str]:
    text = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    return re.findall(r"```python\n(.*?)\n```", text, re.S)


def test_docs_functional_api_example_runs():
    exec(compile(_docs_python_blocks()[0], "docs/algorithms.md", "exec"), {})


def test_docs_own_estimator_example_works_by_name(plugins):
    module = types.ModuleType("docs_median_plugin")
    exec(compile(_docs_python_blocks()[1], "docs/algorithms.md", "exec"), module.__dict__)
    plugins.register(module)
    advantages, _ = compute_advantages("median_baseline", rewards=torch.tensor([1.0, 0.0, 4.0]),
                                       action_mask=torch.ones(3, 2), group_size=3, plugins=plugins)
    assert advantages[:, 0].tolist() == [0.0, -1.0, 3.0]  # median 1
