"""``cispo`` and ``sapo`` equal the anchors' formulas (verl's and TRL's, `anchor_reference`) on random
float64 inputs: several shapes, masks with gaps, extreme ratios (log-ratios beyond the ±20 clamp),
with and without a mismatch correction; per-token losses, aggregated losses and gradients within
1e-6. verl and TRL do not install here (verl needs a GPU stack), so their formulas are transcribed."""

from __future__ import annotations

import pytest
import torch

from rlhf.algorithms import policy_loss
from rlhf.core.types import PolicyLossInputs
from rlhf.plugins.algorithms.policy_losses import (
    CISPOLossConfig, SAPOLossConfig, cispo_policy_loss, sapo_policy_loss)
from tests.algorithms import anchor_reference as ref

pytestmark = pytest.mark.unit

SHAPES = [(1, 1), (3, 7), (8, 33), (16, 5)]
TOL = 1e-6


def random_batch(shape, seed, *, extreme: bool, empty_row: bool = False):
    """float64 (B, A) inputs: log-probs, a log-ratio of N(0, 0.3) (extreme: some tokens ±(5..30)),
    advantages with exact zeros, a mask with gaps (every row keeps a token unless ``empty_row``)."""
    generator = torch.Generator().manual_seed(seed)
    batch, width = shape
    old = -torch.rand(shape, generator=generator, dtype=torch.float64) * 4
    log_ratio = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.3
    if extreme:
        far = torch.rand(shape, generator=generator, dtype=torch.float64) < 0.3
        size = 5 + torch.rand(shape, generator=generator, dtype=torch.float64) * 25
        sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0).to(torch.float64)
        log_ratio = torch.where(far, sign * size, log_ratio)
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.where(torch.rand(shape, generator=generator) < 0.1, torch.zeros_like(advantages), advantages)
    mask = (torch.rand(shape, generator=generator) < 0.7).to(torch.float64)  # gaps anywhere
    mask[:, 0] = 1.0
    if empty_row and batch > 1:
        mask[1] = 0.0
    rollout = old + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.4
    return old + log_ratio, old, advantages, mask, rollout


def ours(loss_fn, config, logprobs, old, advantages, mask, rollout=None):
    """Our per-token loss and the gradient of Σ ℓ m with respect to logprobs."""
    current = logprobs.clone().requires_grad_(True)
    loss, _ = loss_fn(PolicyLossInputs(logprobs=current, old_logprobs=old, advantages=advantages, loss_mask=mask,
                                       rollout_logprobs=rollout), config)
    (loss * mask).sum().backward()
    return loss.detach(), current.grad


def close(got, expected):
    assert got.dtype == torch.float64
    assert (got - expected).abs().max().item() <= TOL, (got - expected).abs().max().item()


def tis_weights(old, rollout, low=0.5, high=5.0):
    """The ``tis`` weight as verl receives it (``rollout_is_weights``): clamp(exp(old - rollout), lo, hi)."""
    return torch.exp(old - rollout).clamp(low, high)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("clip_low, clip_high", [(1.0, 0.2), (0.2, 0.28), (10.0, 4.0)])
def test_cispo_equals_verl_per_token(shape, extreme, clip_low, clip_high):
    logprobs, old, advantages, mask, _ = random_batch(shape, seed=sum(shape), extreme=extreme)
    loss, grad = ours(cispo_policy_loss, CISPOLossConfig(clip_low=clip_low, clip_high=clip_high),
                      logprobs, old, advantages, mask)
    expected_loss, expected_grad = ref.verl_cispo(logprobs, old, advantages, mask, clip_low=clip_low,
                                                  clip_high=clip_high)
    close(loss, expected_loss)
    close(grad, expected_grad)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("epsilon_max", [1.28, 5.0])
def test_cispo_with_no_lower_bound_equals_trl(shape, epsilon_max):
    """TRL bounds the weight above only, at ε_max: ours with ε_low = 1, ε_high = ε_max - 1. Its ratio is
    not clamped, which changes nothing: the weight is clipped either way and carries no gradient."""
    logprobs, old, advantages, mask, _ = random_batch(shape, seed=7 + shape[1], extreme=True)
    loss, grad = ours(cispo_policy_loss, CISPOLossConfig(clip_low=1.0, clip_high=epsilon_max - 1),
                      logprobs, old, advantages, mask)
    expected_loss, expected_grad = ref.trl_cispo(logprobs, old, advantages, mask, epsilon_high=epsilon_max)
    close(loss, expected_loss)
    close(grad, expected_grad)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 4.0)])
def test_sapo_equals_verl_and_trl_per_token(shape, extreme, tau_pos, tau_neg):
    logprobs, old, advantages, mask, _ = random_batch(shape, seed=3 * sum(shape), extreme=extreme)
    loss, grad = ours(sapo_policy_loss, SAPOLossConfig(tau_pos=tau_pos, tau_neg=tau_neg),
                      logprobs, old, advantages, mask)
    for anchor in (ref.verl_sapo, ref.trl_sapo):  # TRL's unclamped ratio differs by < 1e-8 beyond ±20
        expected_loss, expected_grad = anchor(logprobs, old, advantages, mask, tau_pos=tau_pos, tau_neg=tau_neg)
        close(loss, expected_loss)
        close(grad, expected_grad)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_a_tis_correction_multiplies_the_loss_as_verls_rollout_weights(shape, name):
    logprobs, old, advantages, mask, rollout = random_batch(shape, seed=11 + shape[0], extreme=True)
    weights = tis_weights(old, rollout)
    if name == "cispo":
        config = CISPOLossConfig(correction="tis")
        got = ours(cispo_policy_loss, config, logprobs, old, advantages, mask, rollout)
        expected = ref.verl_cispo(logprobs, old, advantages, mask, clip_low=1.0, clip_high=0.2, weights=weights)
    else:
        config = SAPOLossConfig(correction="tis")
        got = ours(sapo_policy_loss, config, logprobs, old, advantages, mask, rollout)
        expected = ref.verl_sapo(logprobs, old, advantages, mask, tau_pos=1.0, tau_neg=1.05, weights=weights)
    close(got[0], expected[0])
    close(got[1], expected[1])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("empty_row", [False, True])
def test_the_aggregated_losses_and_gradients_equal_verls(shape, empty_row):
    """Through the functional API (the formula training runs): cispo with ``token_mean`` as verl's
    ``token-mean``; sapo with its own per-sequence mean whatever ``aggregation`` says, as verl's
    ``seq-mean-token-mean`` (verl divides by Σ m + 1e-8, we by max(Σ m, 1): 1e-8 relative)."""
    logprobs, old, advantages, mask, _ = random_batch(shape, seed=5 + sum(shape), extreme=True, empty_row=empty_row)
    for name, reference, aggregate in (
            ("cispo", lambda: ref.verl_cispo(logprobs, old, advantages, mask, clip_low=1.0, clip_high=0.2),
             ref.verl_token_mean),
            ("sapo", lambda: ref.verl_sapo(logprobs, old, advantages, mask, tau_pos=1.0, tau_neg=1.05),
             ref.verl_seq_mean_token_mean)):
        current = logprobs.clone().requires_grad_(True)
        loss, _ = policy_loss(name, logprobs=current, old_logprobs=old, advantages=advantages, loss_mask=mask,
                              aggregation="token_mean")
        loss.backward()
        expected, expected_grad = aggregate(*reference(), mask)
        assert abs(loss.item() - expected.item()) <= TOL, (name, loss.item(), expected.item())
        close(current.grad, expected_grad)


@pytest.mark.parametrize("shape", [(3, 7), (8, 33)])
def test_sapo_per_sequence_mean_equals_trls_when_every_row_has_tokens(shape):
    logprobs, old, advantages, mask, _ = random_batch(shape, seed=13, extreme=False)
    current = logprobs.clone().requires_grad_(True)
    loss, _ = policy_loss("sapo", logprobs=current, old_logprobs=old, advantages=advantages, loss_mask=mask)
    loss.backward()
    expected, expected_grad = ref.trl_sequence_mean(
        *ref.trl_sapo(logprobs, old, advantages, mask, tau_pos=1.0, tau_neg=1.05), mask)
    assert abs(loss.item() - expected.item()) <= TOL
    close(current.grad, expected_grad)


def test_on_policy_both_give_the_plain_policy_gradient():
    """At ratio 1 CISPO's weight is 1 and SAPO's gate weight 4σ(0)(1 - σ(0)) = 1: ∇ℓ = -Â."""
    logprobs, _, advantages, mask, _ = random_batch((4, 6), seed=1, extreme=False)
    for loss_fn, config in ((cispo_policy_loss, CISPOLossConfig()), (sapo_policy_loss, SAPOLossConfig())):
        _, grad = ours(loss_fn, config, logprobs, logprobs, advantages, mask)
        close(grad, -advantages * mask)


def test_metrics():
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -0.5]], dtype=torch.float64)
    old = torch.tensor([[0.0, -1.5, -1.0, -1.5]], dtype=torch.float64)  # ratios 1, e^0.5, e^-1, e
    advantages = torch.tensor([[1.0, 1.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    inputs = PolicyLossInputs(logprobs=logprobs, old_logprobs=old, advantages=advantages, loss_mask=mask)
    _, metrics = cispo_policy_loss(inputs, CISPOLossConfig(clip_low=0.2, clip_high=0.2))
    assert metrics["policy/clip_frac"].item() == pytest.approx(3 / 4)  # e^0.5, e > 1.2, e^-1 < 0.8
    assert metrics["policy/approx_kl"].item() == pytest.approx((0 - 0.5 + 1 - 1) / 4)
    _, metrics = sapo_policy_loss(inputs, SAPOLossConfig())
    assert "policy/clip_frac" not in metrics
    ratio = torch.exp(logprobs - old)
    tau = torch.tensor([[1.0, 1.0, 1.05, 1.05]], dtype=torch.float64)  # τ_neg where Â <= 0
    sigma = torch.sigmoid(tau * (ratio - 1))
    assert metrics["policy/gate_weight"].item() == pytest.approx((4 * sigma * (1 - sigma) * ratio).mean().item())


@pytest.mark.parametrize("config_cls, settings, message", [
    (CISPOLossConfig, {"clip_high": -0.1}, "cispo clip ranges"),
    (CISPOLossConfig, {"correction": "nope"}, "unknown mismatch correction"),
    (SAPOLossConfig, {"tau_neg": 0.0}, "sapo temperatures must be positive"),
    (SAPOLossConfig, {"tau_pos": 0.0}, "sapo temperatures must be positive"),
    (SAPOLossConfig, {"correction_bounds": (2.0, 1.0)}, "correction_bounds"),
])
def test_bad_settings_are_user_errors(config_cls, settings, message):
    from rlhf.core.errors import RlhfError

    with pytest.raises(RlhfError, match=message):
        config_cls(**settings)


def test_zero_clip_ranges_are_allowed_a_fixed_weight_of_one():
    """ε_low = ε_high = 0 pins CISPO's weight at 1: plain REINFORCE with token-level normalisation."""
    logprobs, old, advantages, mask, _ = random_batch((3, 4), seed=4, extreme=True)
    _, grad = ours(cispo_policy_loss, CISPOLossConfig(clip_low=0.0, clip_high=0.0), logprobs, old, advantages, mask)
    close(grad, -advantages * mask)
    with pytest.raises(Exception, match="cispo clip ranges"):
        CISPOLossConfig(clip_low=-0.01)
    SAPOLossConfig(tau_pos=1e-3, tau_neg=1e-3)


def test_a_correction_without_rollout_logprobs_is_refused():
    from rlhf.core.errors import RlhfError

    logprobs, old, advantages, mask, _ = random_batch((2, 3), seed=2, extreme=False)
    with pytest.raises(RlhfError, match="needs the rollout engine's log-probs"):
        policy_loss("cispo", logprobs=logprobs, old_logprobs=old, advantages=advantages, loss_mask=mask,
                    correction="icepop")


def test_the_presets_flags_reach_their_configs_and_a_correction_asks_for_rollout_logprobs(plugins):
    """``--algo cispo --clip-high 4 --policy-loss.correction tis`` and ``--algo sapo --tau-neg 2`` as a run
    plans them: the settings reach the loss's own config, the engine is asked for its log-probs."""
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.config.train_plan import RunPlan

    config = TrainConfig.from_dict({"model": "m", "data": ["d"], "algo": "cispo", "clip_high": 4.0,
                                    "policy_loss.correction": "tis"}, plugins)
    plan = RunPlan.make(config, plugins)
    assert plan.algorithm.names()["policy_loss"] == "cispo" and plan.algorithm.kl_in == "none"
    assert isinstance(plan.policy_loss_config, CISPOLossConfig) and plan.policy_loss_config.clip_high == 4.0
    assert plan.policy_loss_config.correction == "tis" and plan.rollout_logprobs
    plan = RunPlan.make(TrainConfig.from_dict({"model": "m", "data": ["d"], "algo": "sapo", "tau_neg": 2.0}, plugins),
                        plugins)
    assert isinstance(plan.policy_loss_config, SAPOLossConfig) and plan.policy_loss_config.tau_neg == 2.0
    assert not plan.rollout_logprobs and plan.algorithm.policy_loss_agg.name == "seq_mean_token_mean"


def test_the_defaults_are_the_papers_and_anchors(plugins):
    """CISPO: no lower bound (MiniMax-M1), ε_high 0.2 (verl's example); SAPO: τ 1.0 / 1.05 (the paper, verl,
    TRL); the correction bounds as ppo's; every setting documented in ``rlhf plugins show``."""
    from dataclasses import asdict

    from tests.helpers import run_cli

    assert asdict(CISPOLossConfig()) == {"clip_low": 1.0, "clip_high": 0.2, "correction": None,
                                         "correction_bounds": (0.5, 5.0)}
    assert asdict(SAPOLossConfig()) == {"tau_pos": 1.0, "tau_neg": 1.05, "correction": None,
                                        "correction_bounds": (0.5, 5.0)}
    for name, flags in (("cispo", ["--clip-low", "--clip-high"]), ("sapo", ["--tau-pos", "--tau-neg"])):
        shown = run_cli(plugins, ["plugins", "show", name])
        assert shown.exit_code == 0 and f"policy_loss {name}" in shown.output, shown.output
        assert all(flag in shown.output for flag in flags), shown.output
        assert "rollout/trainer mismatch correction" in shown.output and "[lo, hi] for the correction" in shown.output
    helps = ("ε_low: the IS weight", "ε_high: the IS weight", "τ_pos > 0: the gate", "τ_neg > 0: the gate")
    shown = run_cli(plugins, ["plugins", "show", "cispo"]).output + run_cli(plugins, ["plugins", "show", "sapo"]).output
    assert all(help in shown for help in helps), shown
