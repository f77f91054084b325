"""`rlhf plugins check` runs a component registered with ``implements=`` on the reference fixtures: a
correct third-party implementation passes with its largest difference printed; the bugs users met
in 2026 (a sequence ratio summed instead of multiplied, the importance ratio ignored) fail with it;
``--fixtures DIR`` exports the fixtures as JSON."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import run_cli

pytestmark = pytest.mark.unit


@dataclass(kw_only=True)
class ClipConfig:  # a third party's settings: the fixture cases' names, no dual clip
    clip_low: float = 0.2
    clip_high: float = 0.2
    correction: str | None = None
    correction_bounds: tuple[float, float] = (0.5, 5.0)


def my_ppo(inputs, config):
    """PPO written from the paper, with TIS: -min(ρA, clip(ρ)A) · clamp(exp(old - rollout), lo, hi)."""
    ratio = torch.exp(torch.clamp(inputs.logprobs - inputs.old_logprobs, -20, 20))
    clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    loss = -torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    if config.correction == "tis":
        low, high = config.correction_bounds
        loss = loss * torch.exp(inputs.old_logprobs - inputs.rollout_logprobs).clamp(low, high).detach()
    return loss * inputs.loss_mask, {}


def ppo_ignoring_the_ratio(inputs, config):
    """Liger#1088's bug: the ratio is taken as 1 in the value (the gradient is the on-policy one)."""
    ratio = torch.exp(inputs.logprobs - inputs.logprobs.detach())
    return -ratio * inputs.advantages * inputs.loss_mask, {}


def _gspo(inputs, config, *, summed):
    mask = inputs.loss_mask
    log_ratio = (inputs.logprobs - inputs.old_logprobs) * mask
    tokens = mask.sum(-1).clamp(min=1)
    if summed:  # unsloth-zoo#870's bug: the token ratios summed (and averaged) instead of multiplied
        ratio = (torch.exp(log_ratio) * mask).sum(-1) / tokens
    else:  # the geometric mean: the product of the token ratios, to the power 1 / tokens
        ratio = torch.exp(log_ratio.sum(-1) / tokens)
    ratio = ratio[:, None]
    clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    return -torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages) * mask, {}


def my_gspo(inputs, config):
    return _gspo(inputs, config, summed=False)


def summed_gspo(inputs, config):
    return _gspo(inputs, config, summed=True)


def my_k3(logprobs, ref_logprobs):
    delta = ref_logprobs - logprobs
    return torch.expm1(delta) - delta


def check(plugins, make_plugin, name, obj, *args, tolerance=None, **flags):
    hook = "register_kl_estimators" if name.endswith("kl") else "register_policy_losses"
    plugins.register(make_plugin(f"third_party_{name}", **{hook: lambda register: register(name, obj, **flags)}))
    return run_cli(plugins, ["plugins", "check", name, *args] + (["--tolerance", str(tolerance)] if tolerance else []))


def largest(output, fixture_set):
    return float(re.search(rf"reference fixtures '{fixture_set}': \d+ case\(s\), largest difference (\S+)",
                           output).group(1))


def test_a_correct_third_party_ppo_with_tis_passes(plugins, make_plugin):
    result = check(plugins, make_plugin, "my_ppo", my_ppo, config_cls=ClipConfig, implements=("ppo", "tis"))
    assert result.exit_code == 0, result.output
    assert largest(result.output, "ppo") < 1e-12 and largest(result.output, "tis") < 1e-12
    assert "reference fixtures 'ppo': 2 case(s)" in result.output
    assert "case 'dual clip' skipped: its config has no dual_clip" in result.output  # an optional feature
    assert "reference fixtures 'tis': 1 case(s)" in result.output  # only the tis case on ppo runs


def test_a_correct_gspo_and_k3_pass(plugins, make_plugin):
    result = check(plugins, make_plugin, "my_gspo", my_gspo, config_cls=ClipConfig, implements="gspo")
    assert result.exit_code == 0 and largest(result.output, "gspo") < 1e-9, result.output
    assert "no case ran" not in result.output and "reference fixtures 'gspo': 1 case(s)" in result.output
    result = check(plugins, make_plugin, "my_kl", my_k3, implements="k3")
    assert result.exit_code == 0 and largest(result.output, "k3") < 1e-12, result.output
    assert "reference fixtures 'k3': 2 case(s)" in result.output and "no case ran" not in result.output


def test_a_sequence_ratio_summed_instead_of_multiplied_fails_with_the_largest_difference(plugins, make_plugin):
    result = check(plugins, make_plugin, "summed_gspo", summed_gspo, config_cls=ClipConfig, implements="gspo")
    assert result.exit_code == 1, result.output
    found = re.search(r"policy loss 'summed_gspo': does not match the reference fixtures of 'gspo': largest "
                      r"difference (\S+) at case '[^']+', (loss|grad_logprobs)\[\d+, \d+\] \(tolerance 1e-05", result.output)
    assert found and float(found.group(1)) > 1e-3, result.output
    assert "contract holds" not in result.output


def test_a_loss_that_ignores_the_importance_ratio_fails(plugins, make_plugin):
    result = check(plugins, make_plugin, "lazy_ppo", ppo_ignoring_the_ratio, config_cls=ClipConfig,
                   implements="ppo")
    assert result.exit_code == 1, result.output
    found = re.search(r"does not match the reference fixtures of 'ppo': largest difference (\S+)", result.output)
    assert found and float(found.group(1)) > 0.1, result.output


def test_the_tolerance_decides(plugins, make_plugin):
    def float32_k3(logprobs, ref_logprobs):  # right, in float32: differences around 1e-7
        delta = (logprobs - ref_logprobs).float()
        return (torch.exp(-delta) - 1 + delta).to(logprobs.dtype)

    result = check(plugins, make_plugin, "f32_kl", float32_k3, implements="k3")
    assert result.exit_code == 0, result.output
    assert 1e-9 < largest(result.output, "k3") < 1e-5
    result = check(plugins, make_plugin, "f32b_kl", float32_k3, "--tolerance", "1e-10", implements="k3")
    assert result.exit_code == 1 and "tolerance 1e-10" in result.output, result.output


def test_implementing_a_method_without_fixtures_is_an_error(plugins, make_plugin):
    result = check(plugins, make_plugin, "odd_kl", my_k3, implements="k4")
    assert result.exit_code == 1
    assert "implements 'k4', which has no reference fixtures; the kl estimator sets are: k1, k2, k3" in result.output


def test_a_correction_without_a_loss_it_runs_on_is_an_error(plugins, make_plugin):
    result = check(plugins, make_plugin, "only_tis", my_ppo, config_cls=ClipConfig, implements="tis")
    assert result.exit_code == 1
    assert "implements 'tis' but ran none of its reference fixtures" in result.output
    assert "its cases run on cispo, gspo, ppo, sapo" in result.output


def test_without_implements_no_fixture_runs(plugins, make_plugin):
    result = check(plugins, make_plugin, "plain_ppo", ppo_ignoring_the_ratio, config_cls=ClipConfig)
    assert result.exit_code == 0 and "reference fixtures" not in result.output, result.output


def test_the_fixtures_export_as_json(plugins, tmp_path):
    result = run_cli(plugins, ["plugins", "check", "--fixtures", str(tmp_path / "out" / "fixtures")])
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "out" / "fixtures").iterdir())
    assert files == ["advantage_estimator.json", "kl_estimator.json", "loss_aggregation.json", "policy_loss.json"]
    policy = json.loads((tmp_path / "out" / "fixtures" / "policy_loss.json").read_text())
    assert set(policy["sets"]) == {"ppo", "gspo", "cispo", "sapo", "tis", "icepop", "seq_mask_tis"}
    case = policy["sets"]["cispo"]["cases"][0]
    assert set(case["inputs"]) >= {"logprobs", "old_logprobs", "advantages", "loss_mask", "grad_output"}
    assert set(case["expected"]) == {"loss", "grad_logprobs"} and policy["tolerance"] == 1e-5
    assert run_cli(plugins, ["plugins", "check"]).exit_code == 2  # neither a name nor --fixtures


def test_a_token_mean_that_claims_to_be_the_per_sequence_mean_fails(plugins, make_plugin):
    """It keeps the aggregation contract (it adds up over micro-batches) but is not the method it claims;
    the output is a scalar: no index in the message."""
    def token_mean(loss, loss_mask, norm):
        return (loss * loss_mask).sum() / norm.num_tokens

    plugins.register(make_plugin("third_party_agg", register_loss_aggregations=lambda register: register(
        "my_seq_mean", token_mean, implements="seq_mean_token_mean")))
    result = run_cli(plugins, ["plugins", "check", "my_seq_mean"])
    assert result.exit_code == 1, result.output
    assert re.search(r"reference fixtures of 'seq_mean_token_mean': largest difference \S+ at case '[^']+', "
                     r"(value|grad_loss\[\d+, \d+\]) \(tolerance", result.output), result.output
