"""The shipped reference fixtures (rlhf/algorithms/fixtures/*.json) are right: what their generator makes
(tests/algorithms/make_fixtures.py), every built-in component claims and matches them to the last bits
of float64 (`LAST_BITS`: torch's vectorised exp and log differ by an ulp between AVX-512 and AVX2
CPUs, so a fixture made on one machine is a few ulps off on another), and
their expected values agree with references that do not run our code: cispo and sapo with the
transcriptions of verl and TRL (`anchor_reference`), the estimators with the loop oracle (`oracle`),
the KL estimators and the aggregations with their formulas written out."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms.conformance import FIXTURE_KINDS, conform, implemented, load_fixtures
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.core.plugin_host.settings import build_component_config, setting_fields
from tests.algorithms import anchor_reference, make_fixtures, oracle

pytestmark = pytest.mark.unit
LAST_BITS = 8 * torch.finfo(torch.float64).eps  # relative to max(1, |expected|), as the plugin check's tolerance


def t(value):
    return torch.tensor(value, dtype=torch.float64)


def cases(kind, name):
    return load_fixtures(kind)["sets"][name]["cases"]


def test_the_shipped_fixtures_are_what_the_generator_makes():
    assert make_fixtures.main(["--check"]) == 0


def test_every_builtin_implements_its_own_fixtures_and_matches_them_exactly():
    plugins = build_plugin_manager(load_entrypoints=False)
    covered = {kind: set() for kind in FIXTURE_KINDS}
    for kind in FIXTURE_KINDS:
        for component in plugins.registry(kind).components():
            names = implemented(component.capabilities)
            assert component.name in names, (kind, component.name)
            config_cls = component.load_config_cls()
            results = conform(kind, component.load(), names, settable={f.name for f in setting_fields(config_cls)},
                              make_config=lambda s, c=config_cls: build_component_config(
                                  c, settings=s, run_values={}, who="", flag=""), tolerance=LAST_BITS)
            for result in results:
                assert result.cases and not result.failed, (component.name, result)
                covered[kind].add(result.name)
    for kind in FIXTURE_KINDS:  # every set is some built-in's
        assert covered[kind] == set(load_fixtures(kind)["sets"]), kind
    assert {"tis", "icepop", "seq_mask_tis"} <= covered["policy_loss"]


def _verl(name, case):
    """verl's per-token loss and gradient of Σ loss · grad_output on a cispo or sapo case."""
    inputs, settings = case["inputs"], case["settings"]
    weights = None
    if settings.get("correction") is not None:
        weights = t(case["reference"]["correction_weights"])
    args = (t(inputs["logprobs"]), t(inputs["old_logprobs"]), t(inputs["advantages"]), t(inputs["loss_mask"]))
    if name == "cispo":
        loss, grad = anchor_reference.verl_cispo(*args, clip_low=settings["clip_low"],
                                                 clip_high=settings["clip_high"], weights=weights)
    else:
        loss, grad = anchor_reference.verl_sapo(*args, tau_pos=settings["tau_pos"], tau_neg=settings["tau_neg"],
                                                weights=weights)
    return loss, grad * t(inputs["grad_output"])  # each token's loss depends on its own log-prob only


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_the_cispo_and_sapo_fixtures_are_verls_values(name):
    checked = 0
    for set_name in (name, "tis", "icepop", "seq_mask_tis"):
        for case in cases("policy_loss", set_name):
            if set_name != name and case["loss"] != name:
                continue
            loss, grad = _verl(name, case)
            assert (t(case["expected"]["loss"]) - loss).abs().max() <= 1e-9, case["name"]
            assert (t(case["expected"]["grad_logprobs"]) - grad).abs().max() <= 1e-9, case["name"]
            checked += 1
    assert checked == 5


def test_the_tis_weights_are_the_clamped_ratio():
    for case in cases("policy_loss", "tis"):
        inputs = case["inputs"]
        expected = torch.exp(t(inputs["old_logprobs"]) - t(inputs["rollout_logprobs"])).clamp(0.5, 5.0)
        assert (t(case["reference"]["correction_weights"]) - expected).abs().max() <= 1e-12


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp", "reinforce_pp_baseline", "rloo", "grpo", "dr_grpo"])
def test_the_estimator_fixtures_are_the_loop_oracles_values(estimator):
    checked = 0
    for case in cases("advantage_estimator", estimator):
        inputs, settings = case["inputs"], case["settings"]
        if "sample_mask" in inputs:
            continue  # the oracle has no sample mask (tests/algorithms/test_plugin.py covers it)
        mask = [[int(v) for v in row] for row in inputs["action_mask"]]
        advantages, returns = oracle.advantages(
            estimator, inputs["rewards"], mask, inputs["group_size"], values=inputs.get("values"), kl=inputs["kl"],
            beta=inputs["kl_coef"], gamma=settings["gamma"], lambd=settings["lambd"], std_norm=settings["std_norm"],
            clip=settings["reward_clip"])
        assert (t(case["expected"]["advantages"]) - t(advantages)).abs().max() <= 1e-9, case["name"]
        assert (t(case["expected"]["returns"]) - t(returns)).abs().max() <= 1e-9, case["name"]
        checked += 1
    assert checked == 2


KL = {  # value, d value / d logprobs, of δ = logprobs - ref_logprobs
    "k1": (lambda d: d, lambda d: torch.ones_like(d)),
    "k2": (lambda d: d * d / 2, lambda d: d),
    "k3": (lambda d: torch.exp(-d) - 1 + d, lambda d: 1 - torch.exp(-d)),
}


@pytest.mark.parametrize("name", sorted(KL))
def test_the_kl_fixtures_are_schulmans_estimators(name):
    value, derivative = KL[name]
    for case in cases("kl_estimator", name):
        inputs = case["inputs"]
        delta = t(inputs["logprobs"]) - t(inputs["ref_logprobs"])
        assert (t(case["expected"]["kl"]) - value(delta)).abs().max() <= 1e-9
        assert (t(case["expected"]["grad_logprobs"]) - derivative(delta) * t(inputs["grad_output"])).abs().max() <= 1e-9


def _aggregation(name, loss, mask, inputs):
    """(value, d value / d loss) of each aggregation, written out per row."""
    tokens, sequences, budget = inputs["num_tokens"], inputs["num_sequences"], inputs["max_new_tokens"]
    per_row = mask.sum(-1, keepdim=True)
    weights = {
        "token_mean": mask / tokens,
        "seq_mean_token_mean": mask / per_row.clamp(min=1) / sequences,
        "seq_mean_token_sum": mask / sequences,
        "seq_mean_token_sum_norm": mask / budget / sequences,
    }[name]
    return (loss * weights).sum(), weights


@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_the_aggregation_fixtures_are_their_formulas(name):
    for case in cases("loss_aggregation", name):
        inputs = case["inputs"]
        value, grad = _aggregation(name, t(inputs["loss"]), t(inputs["loss_mask"]), inputs)
        assert math.isclose(case["expected"]["value"], value.item(), rel_tol=1e-12, abs_tol=1e-12)
        assert (t(case["expected"]["grad_loss"]) - grad).abs().max() <= 1e-12
