"""`rlhf plugins check` catches real mistakes: each broken component (tests/plugin_kit/broken.py)
makes the command exit 1 with a message naming the broken promise."""

from __future__ import annotations

import pytest

from tests.helpers import run_cli
from tests.plugin_kit import broken

ESTIMATORS = [
    (broken.unmasked_estimator, "advantages (random rewards) is not zero where action_mask is 0"),
    (broken.nan_on_constant_group, "advantages (a group with equal rewards) is NaN or inf"),
    (broken.interleaved_groups, "does not treat rows [g*n, (g+1)*n) as one group"),
    (broken.ignores_sample_mask, "advantages of a sample left out by sample_mask (False) should be 0"),
]
LOSSES = [
    (broken.unmasked_policy_loss, "the per-token loss is not zero where loss_mask is 0"),
    (broken.detached_policy_loss, "the loss does not depend on inputs.logprobs"),
    (broken.batch_normalised_policy_loss, "splitting the batch into two micro-batches changed the per-token losses"),
]


def check(plugins, make_plugin, hook, name, obj, **flags):
    plugins.register(make_plugin(f"broken_{name}", **{hook: lambda register: register(name, obj, **flags)}))
    return run_cli(plugins, ["plugins", "check", name])


@pytest.mark.unit
@pytest.mark.parametrize("fn, message", ESTIMATORS, ids=[f.__name__ for f, _ in ESTIMATORS])
def test_a_broken_estimator_fails_its_check(plugins, make_plugin, fn, message):
    result = check(plugins, make_plugin, "register_advantage_estimators", "bad_adv", fn, needs_groups=True)
    assert result.exit_code == 1, result.output
    assert "Error: advantage estimator 'bad_adv': " in result.output
    assert message in result.output


@pytest.mark.unit
@pytest.mark.parametrize("fn, message", LOSSES, ids=[f.__name__ for f, _ in LOSSES])
def test_a_broken_policy_loss_fails_its_check(plugins, make_plugin, fn, message):
    result = check(plugins, make_plugin, "register_policy_losses", "bad_loss", fn)
    assert result.exit_code == 1 and message in result.output, result.output


@pytest.mark.unit
def test_a_kl_estimator_that_is_not_zero_at_the_reference_fails(plugins, make_plugin):
    result = check(plugins, make_plugin, "register_kl_estimators", "bad_kl", broken.shifted_kl)
    assert result.exit_code == 1
    assert "the KL of a policy equal to its reference should be 0, got up to 0.1" in result.output


@pytest.mark.unit
def test_an_aggregation_that_divides_by_the_micro_batch_fails(plugins, make_plugin):
    result = check(plugins, make_plugin, "register_loss_aggregations", "bad_agg", broken.micro_batch_token_mean)
    assert result.exit_code == 1
    assert "the micro-batch losses of a step split [3, 3] do not add up to the whole step's loss" in result.output


@pytest.mark.unit
def test_a_reward_of_the_wrong_length_fails(plugins, make_plugin):
    result = check(plugins, make_plugin, "register_rewards", "short", broken.short_reward)
    assert result.exit_code == 1
    assert "Error: reward 'short': returned the wrong thing: " in result.output
    assert "3" in result.output and "4" in result.output


@pytest.mark.unit
def test_a_nan_reward_fails(plugins, make_plugin):
    result = check(plugins, make_plugin, "register_rewards", "nan_reward", broken.nan_reward)
    assert result.exit_code == 1
    assert "scores must be finite numbers or None" in result.output or "returned the wrong thing" in result.output


@pytest.mark.unit
def test_an_unpicklable_reward_fails(plugins, make_plugin):
    result = check(plugins, make_plugin, "register_rewards", "closure", lambda completions: [0.0] * len(completions))
    assert result.exit_code == 1
    assert "Error: reward 'closure': cannot be pickled" in result.output
    assert "define it at module level" in result.output


@pytest.mark.unit
def test_an_async_reward_is_called_and_passes(plugins, make_plugin):
    result = check(plugins, make_plugin, "register_rewards", "async_len", broken.async_reward)
    assert result.exit_code == 0, result.output
    assert "called batched, async on 4 samples" in result.output


@pytest.mark.unit
def test_a_preset_naming_a_missing_piece_fails(plugins, make_plugin):
    from rlhf.core.types import AlgorithmPreset

    preset = AlgorithmPreset(advantage="no_such_estimator")
    result = check(plugins, make_plugin, "register_algorithms", "bad_algo", preset)
    assert result.exit_code == 1
    assert "names advantage estimator 'no_such_estimator', which cannot be used" in result.output


@pytest.mark.run
def test_an_adapter_whose_export_does_not_load_fails(plugins, make_plugin):
    result = check(plugins, make_plugin, "register_models", "no_export", broken.ExportsNothing,
                   roles=("policy", "reference"))
    assert result.exit_code == 1, result.output
    assert "Error: model 'no_export': save wrote" in result.output
    assert "which AutoModelForCausalLM/AutoTokenizer.from_pretrained cannot load" in result.output


@pytest.mark.run
@pytest.mark.parametrize("cls, message", [
    (broken.StepChangesNothing, "step() did not change the weights after backward(loss)"),
    (broken.ForgetsOptimizerState, "state_dict() misses optimizer or schedule state"),
])
def test_a_broken_backend_fails(plugins, make_plugin, cls, message):
    result = check(plugins, make_plugin, "register_train_backends", "bad_backend", cls)
    assert result.exit_code == 1, result.output
    assert message in result.output


@pytest.mark.run
def test_a_correct_backend_of_our_own_passes(plugins, make_plugin):
    result = check(plugins, make_plugin, "register_train_backends", "good_backend", broken.GoodBackend)
    assert result.exit_code == 0, result.output
    assert "a restored backend takes the same next step" in result.output


@pytest.mark.run
@pytest.mark.parametrize("cls, flags, message", [
    (broken.OneSampleShort, {}, "generate(2 prompts, n=3) should return a list of 6 Generation, got 5"),
    (broken.IgnoresStop, {}, "goes on after the stop string"),
    (broken.IgnoresSeeds, {"continuous_batching": True}, "generate_one: the same prompt with the same seed gave"),
])
def test_a_broken_engine_fails(plugins, make_plugin, cls, flags, message):
    result = check(plugins, make_plugin, "register_rollout_engines", "bad_engine", cls, **flags)
    assert result.exit_code == 1, result.output
    assert message in result.output


@pytest.mark.unit
@pytest.mark.parametrize("cls, code, message", [
    (broken.GoodObjective, 0, "two micro-batches weighted by their units give the whole batch's loss"),
    (broken.SumsInsteadOfMeans, 1, "loss must be the mean over units(batch)"),
    (broken.DetachedLoss, 1, "the loss does not depend on the trained model (no gradient)"),
])
def test_objectives_are_checked_on_a_tiny_model(plugins, make_plugin, cls, code, message):
    result = check(plugins, make_plugin, "register_objectives", "my_objective", cls)
    assert result.exit_code == code, result.output
    assert message in result.output


def _first_half(groups, config):
    return [i < len(groups) // 2 for i in range(len(groups))]


def _one_flag(groups, config):
    return [True]


def _revives_dropped(trajectories, rewards, config):
    return [0.0 if r is None else r for r in rewards], {}


def _unnamespaced_metric(trajectories, rewards, config):
    return list(rewards), {"penalty": 1.0}


@pytest.mark.unit
@pytest.mark.parametrize("fn, message", [
    (_first_half, "the verdict of a group changed with its position in the step"),
    (_one_flag, "returned 1 flags for 4 prompt groups"),
], ids=["positional", "one_flag"])
def test_a_broken_sample_filter_fails_its_check(plugins, make_plugin, fn, message):
    result = check(plugins, make_plugin, "register_sample_filters", "bad_filter", fn)
    assert result.exit_code == 1 and "Error: sample filter 'bad_filter': " in result.output
    assert message in result.output, result.output


@pytest.mark.unit
@pytest.mark.parametrize("fn, message", [
    (_revives_dropped, "was dropped (reward None) and came back as 0.0; keep it None"),
    (_unnamespaced_metric, "metric 'penalty' needs a namespace"),
], ids=["revives", "metric"])
def test_a_broken_reward_shaping_fails_its_check(plugins, make_plugin, fn, message):
    result = check(plugins, make_plugin, "register_reward_shapings", "bad_shaping", fn)
    assert result.exit_code == 1 and "Error: reward shaping 'bad_shaping': " in result.output
    assert message in result.output, result.output
