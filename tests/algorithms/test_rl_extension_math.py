"""The math of the RL extensions against hand-computed values: GSPO, the seq_mask_tis correction,
the unbiased KL gradient (against the analytic gradient of a small categorical policy), the
adaptive KL controller, the dynamic filter and the length shapings."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms import kl_divergence, policy_loss, policy_objective
from rlhf.algorithms.kl_control import KLController
from rlhf.core.types import PolicyLossInputs, Trajectory
from rlhf.plugins.algorithms.policy_losses import PPOLossConfig, ppo_policy_loss
from rlhf.plugins.filters.dynamic import DynamicFilterConfig, dynamic_filter, keeps_group
from rlhf.plugins.shaping.overlong import OverlongConfig, overlong_shaping
from rlhf.plugins.shaping.truncation import TruncationConfig, truncation_shaping

pytestmark = pytest.mark.unit


# --- GSPO ------------------------------------------------------------------------------------------


def test_gspo_uses_one_clipped_ratio_per_sequence_and_a_per_sequence_mean():
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[0.1, 0.3, 9.0], [0.5, 0.0, 0.0]], requires_grad=True)  # row 0: 2 tokens, row 1: 1
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, metrics = policy_loss("gspo", logprobs=logprobs, old_logprobs=old, advantages=advantages, loss_mask=mask,
                                aggregation="token_mean")  # gspo always aggregates per sequence
    s0, s1 = math.exp(0.2), math.exp(0.5)  # geometric mean ratios of the two sequences
    row0 = -min(s0, 1.2)  # positive advantage: clipped at 1 + 0.2
    row1 = -min(-s1, -1.2)  # negative advantage: the unclipped (larger) loss
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)  # mean over sequences, not the 3 tokens
    loss.backward()
    # row 0 is clipped (no gradient); row 1: d(s1/2)/dlogp = s1/2 on its only token
    expected = torch.tensor([[0.0, 0.0, 0.0], [s1 / 2, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    assert metrics["policy/clip_frac"].item() == pytest.approx(2 / 3)  # row 0's two tokens of three


def test_gspo_gradient_spreads_over_the_tokens_of_the_sequence():
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[0.0, 0.1]], requires_grad=True)
    loss, _ = policy_loss("gspo", logprobs=logprobs, old_logprobs=old, advantages=torch.full((1, 2), -1.0),
                          loss_mask=torch.ones(1, 2))
    loss.backward()  # loss = s = exp(0.05) (unclipped for a negative advantage); ds/dlogp_t = s / 2
    assert torch.allclose(logprobs.grad, torch.full((1, 2), math.exp(0.05) / 2), atol=1e-6)


def test_gspo_with_a_correction_takes_its_ratio_against_the_rollout_logprobs():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    kwargs = dict(logprobs=logprobs, old_logprobs=torch.zeros(1, 2), advantages=torch.full((1, 2), -1.0),
                  loss_mask=torch.ones(1, 2))
    loss, _ = policy_loss("gspo", rollout_logprobs=torch.full((1, 2), -0.4), correction="tis", **kwargs)
    assert loss.item() == pytest.approx(math.exp(0.4))  # ratio exp(mean(logprobs - rollout_logprobs))


# --- seq_mask_tis ----------------------------------------------------------------------------------


def test_seq_mask_tis_drops_whole_sequences_and_keeps_unclamped_token_weights():
    old = torch.tensor([[0.1, -0.1], [2.0, 2.0]])
    rollout = torch.zeros(2, 2)
    inputs = PolicyLossInputs(logprobs=old.clone(), old_logprobs=old, advantages=torch.ones(2, 2),
                              loss_mask=torch.ones(2, 2), rollout_logprobs=rollout)
    config = PPOLossConfig(correction="seq-mask-tis", correction_bounds=(0.5, 1.5))  # OpenRLHF's spelling works
    assert config.correction == "seq_mask_tis"
    loss, metrics = ppo_policy_loss(inputs, config)
    # row 0: geometric mean exp(0) = 1 is inside: weights exp(±0.1), not clamped; ratio 1, so ℓ = -w
    assert torch.allclose(loss[0], -torch.tensor([math.exp(0.1), math.exp(-0.1)]), atol=1e-6)
    # row 1: exp(2) = 7.39 > 1.5: the whole sequence is dropped
    assert torch.equal(loss[1], torch.zeros(2))
    assert metrics["policy/correction_clip_frac"].item() == pytest.approx(0.5)
    tis = ppo_policy_loss(inputs, PPOLossConfig(correction="tis", correction_bounds=(0.5, 1.5)))[0]
    assert tis[1, 0].item() == pytest.approx(-1.5)  # tis clamps instead of dropping


# --- unbiased KL gradient --------------------------------------------------------------------------


def test_unbiased_kl_gradient_equals_the_analytic_reverse_kl_gradient():
    """A categorical policy over 5 tokens, trained off-policy: the expectation of the per-token KL
    term under the sampling (old) policy must have the gradient of KL(π_θ ‖ π_ref)."""
    torch.manual_seed(0)
    theta = torch.randn(5, requires_grad=True)
    theta_old = (theta + 0.3 * torch.randn(5)).detach()  # sampled a little before this update
    ref = torch.randn(5).log_softmax(-1)
    logprobs = theta.log_softmax(-1)  # every token's log-prob under π_θ
    old = theta_old.log_softmax(-1)
    sampling = old.exp().detach()  # probability of drawing each token

    analytic = torch.autograd.grad((logprobs.exp() * (logprobs - ref)).sum(), theta,
                                   retain_graph=True)[0]  # ∇ KL(π_θ ‖ π_ref)
    for estimator in ("k1", "k2", "k3"):
        kl = kl_divergence(estimator, logprobs[None], ref[None], unbiased_gradient=True,
                           old_logprobs=old[None])  # (1, 5)
        surrogate = (sampling * kl[0]).sum()  # E_{y ~ π_old}[kl(y)], exactly
        grad = torch.autograd.grad(surrogate, theta, retain_graph=True)[0]
        assert torch.allclose(grad, analytic, atol=1e-5), estimator
        plain = kl_divergence(estimator, logprobs[None], ref[None])
        assert torch.allclose(kl.detach(), plain.detach()), f"{estimator}: the value must not change"
    biased = torch.autograd.grad((sampling * kl_divergence("k1", logprobs[None], ref[None])[0]).sum(), theta)[0]
    assert not torch.allclose(biased, analytic, atol=1e-3)  # k1's own gradient is not the KL gradient


def test_policy_objective_passes_the_unbiased_gradient_to_its_kl_term():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    common = dict(logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=torch.zeros(1, 2),
                  loss_mask=torch.ones(1, 2), ref_logprobs=ref, kl_estimator="k3", kl_coef=0.5)
    loss, _ = policy_objective("ppo", kl_unbiased_gradient=True, **common)
    loss.backward()  # β·token_mean(kl): gradient β·δ/2 per token (w = 1 on-policy)
    assert torch.allclose(logprobs.grad, 0.5 * (logprobs.detach() - ref) / 2, atol=1e-6)


# --- adaptive KL -----------------------------------------------------------------------------------


def test_adaptive_kl_controller_follows_ziegler_et_al():
    controller = KLController(0.1, target=0.05, horizon=10000)
    controller.update(0.1, 64)  # KL twice the target: error clipped to +0.2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 64 / 10000))
    controller.update(0.045, 100)  # KL 10% under the target
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 64 / 10000) * (1 - 0.1 * 100 / 10000))
    fixed = KLController(0.1)
    fixed.update(5.0, 64)
    assert fixed.value == 0.1


# --- dynamic filter --------------------------------------------------------------------------------


def _trajectory(score, reward=None, tokens=3, env_tokens=0, finish_reason="stop"):
    mask = [0, 0] + [1] * tokens + [0] * env_tokens
    return Trajectory(token_ids=list(range(len(mask))), loss_mask=mask, prompt_length=2, prompt="p", prompt_text="p",
                      completion_text="c", group=0, score=score, reward=score if reward is None else reward,
                      finish_reason=finish_reason)


def test_dynamic_filter_drops_groups_without_variance_or_outside_the_range():
    assert not keeps_group([1.0, 1.0, 1.0], None) and not keeps_group([0.0, 0.0], None)
    assert keeps_group([0.0, 1.0, 1.0], None)
    assert keeps_group([0.0, 1.0, 1.0], (0.0, 1.0)) and not keeps_group([0.0, 1.0, 1.0], (0.0, 0.5))
    assert not keeps_group([0.5], None)  # one scored sample tells nothing
    groups = [[_trajectory(1.0), _trajectory(1.0)], [_trajectory(0.0), _trajectory(1.0)],
              [_trajectory(None, reward=1.0), _trajectory(0.0)]]  # a dropped sample does not count
    assert dynamic_filter(groups, DynamicFilterConfig()) == [False, True, False]


# --- length shapings -------------------------------------------------------------------------------


def test_overlong_penalty_is_linear_in_the_buffer_capped_and_counts_policy_tokens_only():
    config = OverlongConfig(overlong_buffer=4, overlong_penalty_factor=0.5, max_new_tokens=10)  # penalised after 6 tokens
    trajectories = [_trajectory(1.0, tokens=6), _trajectory(1.0, tokens=8), _trajectory(1.0, tokens=10),
                    _trajectory(1.0, tokens=14), _trajectory(1.0, tokens=5, env_tokens=50)]
    shaped, metrics = overlong_shaping(trajectories, [1.0] * 5, config)
    assert shaped == pytest.approx([1.0, 1.0 - 0.5 * 2 / 4, 0.5, 0.5, 1.0])  # capped at the factor
    assert metrics["overlong/penalized"] == pytest.approx(3 / 5)
    assert overlong_shaping(trajectories[:1], [None], config)[0] == [None]  # a dropped sample stays dropped


def test_truncation_scales_or_replaces_the_reward_of_cut_completions():
    trajectories = [_trajectory(1.0, finish_reason="length"), _trajectory(1.0), _trajectory(1.0, finish_reason="budget")]
    scaled, metrics = truncation_shaping(trajectories, [0.8, 0.8, 0.6], TruncationConfig(truncated_reward=0.5))
    assert scaled == pytest.approx([0.4, 0.8, 0.3]) and metrics["truncated/count"] == 2.0
    replaced, _ = truncation_shaping(trajectories, [0.8, 0.8, 0.6], TruncationConfig(truncated_reward=-1.0))
    assert replaced == [-1.0, 0.8, -1.0]


def test_gspo_scales_with_the_advantage_and_clips_on_the_right_side():
    logprobs = torch.tensor([[0.3, 0.3]], requires_grad=True)  # s = exp(0.3) = 1.35, outside [0.8, 1.2]
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    kwargs = dict(logprobs=logprobs, old_logprobs=old, loss_mask=mask)
    up, _ = policy_loss("gspo", advantages=torch.full((1, 2), 2.0), **kwargs)
    down, _ = policy_loss("gspo", advantages=torch.full((1, 2), -2.0), **kwargs)
    assert up.item() == pytest.approx(-1.2 * 2.0)  # positive advantage: the clipped ratio caps the gain
    assert down.item() == pytest.approx(math.exp(0.3) * 2.0)  # negative: the unclipped (larger) loss


def test_the_unbiased_kl_weight_is_clamped_at_ten():
    logprobs = torch.tensor([[0.0]], requires_grad=True)
    ref, old = torch.tensor([[-1.0]]), torch.tensor([[-3.0]])  # π/π_old = e³ ≈ 20, clamped to 10
    kl = kl_divergence("k3", logprobs, ref, unbiased_gradient=True, old_logprobs=old)
    kl.sum().backward()
    assert logprobs.grad.item() == pytest.approx(10.0 * 1.0)  # w·δ with δ = logprobs - ref = 1


def test_metrics_of_several_sampling_rounds_sum_counts_and_weight_means():
    from rlhf.runtime.rl.step_metrics import merge_round_metrics

    rounds = [({"reward/mean": 1.0, "reward/failures": 2.0, "reward/src/count": 1.0}, 4),
              ({"reward/mean": 0.0, "reward/failures": 1.0, "reward/src/count": 3.0}, 12)]
    assert merge_round_metrics(rounds) == {"reward/mean": 0.25, "reward/failures": 3.0, "reward/src/count": 4.0}
    assert merge_round_metrics(rounds[:1]) == rounds[0][0]
