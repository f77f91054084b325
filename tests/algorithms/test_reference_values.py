"""The reference values of docs/algorithms.md and other hand-computed examples, in float32 like a real run.

Every expected number here was worked out by hand (the derivation is in the comment above it).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms import (
    aggregate_loss,
    compute_advantages,
    entropy_from_logits,
    kl_divergence,
    policy_loss,
    value_loss,
)
from rlhf.plugins.algorithms.returns import token_rewards

pytestmark = pytest.mark.unit

approx = pytest.approx


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), width)  # (B, A)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return mask


# --- docs/algorithms.md: group shaping, n = 4, r = [1, 0, 0, 0] ----------------------------------------

# mean 0.25; unbiased std sqrt((0.75² + 3·0.25²)/3) = 0.5; leave-one-out means [0, 1/3, 1/3, 1/3].
GROUP_VALUES = {
    "grpo": [1.5, -0.5, -0.5, -0.5],
    "rloo": [1.0, -1 / 3, -1 / 3, -1 / 3],
    "dr_grpo": [0.75, -0.25, -0.25, -0.25],
}


@pytest.mark.parametrize("estimator", sorted(GROUP_VALUES))
def test_group_estimators_reproduce_design_values(plugins, estimator):
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = torch.ones(4, 3)
    advantages, returns = compute_advantages(estimator, rewards=rewards, action_mask=mask, group_size=4,
                                             plugins=plugins)
    expected = torch.tensor(GROUP_VALUES[estimator])[:, None].expand(4, 3)  # γ = 1: every token gets r̃
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)  # no whitening: advantages = returns


def test_each_group_has_its_own_statistics(plugins):
    # groups [1, 0] (mean 0.5, std 1/√2) and [5, 1] (mean 3, std 2√2)
    rewards = torch.tensor([1.0, 0.0, 5.0, 1.0])
    grpo, _ = compute_advantages("grpo", rewards=rewards, action_mask=torch.ones(4, 1), group_size=2, plugins=plugins)
    root = math.sqrt(2)
    assert grpo[:, 0].tolist() == approx([0.5 * root, -0.5 * root, 2 / (2 * root), -2 / (2 * root)], abs=1e-6)
    rloo, _ = compute_advantages("rloo", rewards=rewards, action_mask=torch.ones(4, 1), group_size=2, plugins=plugins)
    assert rloo[:, 0].tolist() == approx([1.0, -1.0, 4.0, -4.0])


def test_reinforce_pp_baseline_before_whitening_is_the_group_mean_baseline(plugins):
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    advantages, returns = compute_advantages("reinforce_pp_baseline", rewards=rewards, action_mask=torch.ones(4, 3),
                                             group_size=4, plugins=plugins)
    torch.testing.assert_close(returns[:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # Whitened over 12 equal-weight tokens: μ = 0, σ² = (0.75² + 3·0.25²)/4 = 0.1875.
    sigma = math.sqrt(0.1875)
    assert advantages[:, 0].tolist() == approx([0.75 / sigma, -0.25 / sigma, -0.25 / sigma, -0.25 / sigma], rel=1e-6)


# --- docs/algorithms.md: KL estimators at δ = 0.2 -------------------------------------------------------

@pytest.mark.parametrize("estimator, expected", [("k1", 0.2), ("k2", 0.02), ("k3", 0.0187308)])
def test_kl_estimators_reproduce_design_values(plugins, estimator, expected):
    logprobs, ref_logprobs = torch.tensor([[-1.0]]), torch.tensor([[-1.2]])  # δ = 0.2
    assert kl_divergence(estimator, logprobs, ref_logprobs, plugins=plugins).item() == approx(expected, abs=1e-6)


def test_kl_is_clamped_to_ten_and_masked(plugins):
    logprobs, ref_logprobs = torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[-30.0, 30.0, 1.0]])  # δ = 30, -30, -1
    assert kl_divergence("k1", logprobs, ref_logprobs, plugins=plugins).tolist() == [[10.0, -10.0, -1.0]]
    assert kl_divergence("k3", logprobs, ref_logprobs, plugins=plugins)[0, 1].item() == 10.0  # exp(30) clamped
    masked = kl_divergence("k1", logprobs, ref_logprobs, mask=torch.tensor([[1, 0, 1]]), plugins=plugins)
    assert masked.tolist() == [[10.0, 0.0, -1.0]]


# --- docs/algorithms.md: whitening example ---------------------------------------------------------------

def test_reinforce_pp_baseline_whitening_example(plugins):
    # Two prompts × 2 samples, r = [[1, 0], [1, 1]], lengths [2, 1, 3, 1], γ = 1, no KL.
    # Before whitening: [.5, .5 | -.5 | 0, 0, 0 | 0]; μ = 0.5/7 = 1/14, σ² = (2·(3/7)² + (4/7)² +
    # 4·(1/14)²)/7 = 5/49, so Â = (Â - 1/14)·7/√5: 3/√5 = 1.342, -4/√5 = -1.789, -0.5/√5 = -0.224.
    mask = _mask([2, 1, 3, 1], width=4)
    advantages, returns = compute_advantages("reinforce_pp_baseline", rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
                                             action_mask=mask, group_size=2, plugins=plugins)
    root5 = math.sqrt(5)
    expected = torch.tensor([[3 / root5, 3 / root5, 0, 0],
                             [-4 / root5, 0, 0, 0],
                             [-0.5 / root5, -0.5 / root5, -0.5 / root5, 0],
                             [-0.5 / root5, 0, 0, 0]])
    torch.testing.assert_close(advantages, expected)
    assert [round(x, 3) for x in advantages[mask.bool()].tolist()] == [1.342, 1.342, -1.789] + [-0.224] * 4
    torch.testing.assert_close(returns, torch.tensor([[.5, .5, 0, 0], [-.5, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]))

    centred, _ = compute_advantages("reinforce_pp_baseline", rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
                                    action_mask=mask, group_size=2, std_norm=False, plugins=plugins)
    assert centred[mask.bool()].tolist() == approx([3 / 7, 3 / 7, -4 / 7] + [-1 / 14] * 4, abs=1e-6)


# --- GAE with γ < 1 and λ < 1 -----------------------------------------------------------------

def test_gae_hand_computed_three_tokens(plugins):
    # γ = 0.9, λ = 0.8, V = [0.5, 0.4, 0.3], r = 1 on the last token:
    # δ2 = 1 - 0.3 = 0.7;            Â2 = 0.7
    # δ1 = 0.9·0.3 - 0.4 = -0.13;    Â1 = -0.13 + 0.72·0.7 = 0.374
    # δ0 = 0.9·0.4 - 0.5 = -0.14;    Â0 = -0.14 + 0.72·0.374 = 0.12928
    # returns = Â + V = [0.62928, 0.774, 1.0]; Â whitened over the 3 tokens.
    values = torch.tensor([[0.5, 0.4, 0.3]])
    advantages, returns = compute_advantages("gae", rewards=torch.tensor([1.0]), action_mask=torch.ones(1, 3),
                                             values=values, group_size=1, gamma=0.9, lambd=0.8, plugins=plugins)
    assert returns[0].tolist() == approx([0.62928, 0.774, 1.0], abs=1e-6)
    raw = [0.12928, 0.374, 0.7]
    mean = sum(raw) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 3)
    assert advantages[0].tolist() == approx([(a - mean) / std for a in raw], abs=1e-5)


def test_gae_with_kl_in_the_reward(plugins):
    # γ = λ = 1, V = 0, kl = [0.2, 0.4], β = 0.5: R = [-0.1, -0.2 + 1], returns = [0.7, 0.8].
    _, returns = compute_advantages("gae", rewards=torch.tensor([1.0]), action_mask=torch.ones(1, 2),
                                    values=torch.zeros(1, 2), kl=torch.tensor([[0.2, 0.4]]), kl_coef=0.5,
                                    group_size=1, plugins=plugins)
    assert returns[0].tolist() == approx([0.7, 0.8], abs=1e-6)


# --- KL in the reward: placement on a multi-turn mask with holes ------------------------------

# positions: 0 prompt | 1 2 turn one | 3 4 environment | 5 6 turn two | 7 padding
HOLEY_MASK = torch.tensor([[0.0, 1, 1, 0, 0, 1, 1, 0]])
HOLEY_KL = torch.tensor([[9.0, 0.1, 0.2, 9, 9, 0.3, 0.4, 9]])  # 9 at masked positions must not count


def test_token_rewards_put_kl_on_every_action_token_and_the_reward_on_the_last():
    # β = 0.5, r = 2: R = -0.5·kl on action tokens, plus 2 on position 6 (the last where m = 1).
    rewards = token_rewards(torch.tensor([2.0]), HOLEY_MASK, kl=HOLEY_KL, kl_coef=0.5, reward_clip=10.0)
    assert rewards[0].tolist() == approx([0, -0.05, -0.1, 0, 0, -0.15, 1.8, 0], abs=1e-6)
    clipped = token_rewards(torch.tensor([25.0]), HOLEY_MASK, kl=None, kl_coef=0.5, reward_clip=10.0)
    assert clipped[0].tolist() == [0, 0, 0, 0, 0, 0, 10.0, 0]


@pytest.mark.parametrize("gamma, expected", [
    # γ = 1: G6 = 1.8, G5 = 1.65, G2 = 1.55, G1 = 1.5
    (1.0, [0, 1.5, 1.55, 0, 0, 1.65, 1.8, 0]),
    # γ = 0.5 discounts through the environment positions 3 and 4 too (OpenRLHF's semantics):
    # G6 = 1.8, G5 = -0.15 + 0.9 = 0.75, G4 = 0.375, G3 = 0.1875, G2 = -0.1 + 0.09375 = -0.00625,
    # G1 = -0.05 - 0.003125 = -0.053125
    (0.5, [0, -0.053125, -0.00625, 0, 0, 0.75, 1.8, 0]),
])
def test_returns_to_go_on_a_multi_turn_mask(plugins, gamma, expected):
    _, returns = compute_advantages("reinforce_pp", rewards=torch.tensor([2.0]), action_mask=HOLEY_MASK,
                                    kl=HOLEY_KL, kl_coef=0.5, gamma=gamma, group_size=1, plugins=plugins)
    assert returns[0].tolist() == approx(expected, abs=1e-6)


def test_kl_in_the_loss_leaves_the_reward_alone(plugins):
    # kl=None (KL goes in the loss): returns are the bare reward on every action token.
    _, returns = compute_advantages("reinforce_pp", rewards=torch.tensor([2.0]), action_mask=HOLEY_MASK,
                                    kl=None, kl_coef=0.5, group_size=1, plugins=plugins)
    assert returns[0].tolist() == [0, 2, 2, 0, 0, 2, 2, 0]


# --- PPO policy loss -------------------------------------------------------------------------

def _ppo(plugins, ratios, advantages, **kwargs):
    old_logprobs = torch.zeros(1, len(ratios))
    logprobs = torch.tensor([ratios]).log().requires_grad_()
    loss, metrics = policy_loss("ppo", logprobs=logprobs, old_logprobs=old_logprobs,
                                advantages=torch.tensor([advantages]),
                                loss_mask=torch.ones(1, len(ratios)), plugins=plugins, **kwargs)
    return loss, metrics, logprobs


def test_ppo_asymmetric_clip(plugins):
    # ε_low = 0.2, ε_high = 0.28, so ρ is clipped to [0.8, 1.28]:
    # ρ 1.5, Â +1: min(1.5, 1.28) = 1.28 → ℓ -1.28 (clipped)
    # ρ 0.5, Â +1: min(0.5, 0.8) = 0.5 → ℓ -0.5
    # ρ 1.5, Â -1: min(-1.5, -1.28) = -1.5 → ℓ 1.5
    # ρ 0.5, Â -1: min(-0.5, -0.8) = -0.8 → ℓ 0.8 (clipped)
    # ρ 1.25, Â +1: inside the upper range → ℓ -1.25 (with ε_high = 0.2 it would be clipped to 1.2)
    loss, metrics, _ = _ppo(plugins, [1.5, 0.5, 1.5, 0.5, 1.25], [1.0, 1.0, -1.0, -1.0, 1.0],
                            clip_low=0.2, clip_high=0.28)
    assert loss.item() == approx((-1.28 - 0.5 + 1.5 + 0.8 - 1.25) / 5, abs=1e-6)
    assert metrics["policy/clip_frac"].item() == approx(2 / 5)
    symmetric, _, _ = _ppo(plugins, [1.25], [1.0])
    assert symmetric.item() == approx(-1.2, abs=1e-6)


def test_ppo_dual_clip(plugins):
    # c = 3: ρ 5, Â -1: min(-5, -1.2) = -5, max(-5, -3) = -3 → ℓ 3 (dual clip active)
    #        ρ 2, Â -1: min(-2, -1.2) = -2, max(-2, -3) = -2 → ℓ 2
    #        ρ 5, Â +1: min(5, 1.2) = 1.2 → ℓ -1.2 (dual clip only acts on Â < 0)
    loss, metrics, logprobs = _ppo(plugins, [5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], dual_clip=3.0)
    assert loss.item() == approx((3 + 2 - 1.2) / 3, abs=1e-5)
    assert metrics["policy/dual_clip_frac"].item() == approx(1 / 3)
    loss.backward()
    # Only the middle token is unclipped: dℓ/dlogp = -Â·ρ = 2, over 3 tokens.
    assert logprobs.grad[0].tolist() == approx([0.0, 2 / 3, 0.0], abs=1e-6)
    plain, _, _ = _ppo(plugins, [5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    assert plain.item() == approx((5 + 2 - 1.2) / 3, abs=1e-5)


def test_ppo_dual_clip_leaves_small_positive_advantages_alone(plugins):
    # c = 3, ρ 5, Â 0.5: min(2.5, 1.2·0.5) = 0.6 → ℓ -0.6 with or without dual clip (Â ≥ 0)
    loss, metrics, _ = _ppo(plugins, [5.0], [0.5], dual_clip=3.0)
    assert loss.item() == approx(-0.6, abs=1e-6) and metrics["policy/dual_clip_frac"].item() == 0.0


def test_ppo_log_ratio_is_clamped_before_exp(plugins):
    loss, _ = policy_loss("ppo", logprobs=torch.tensor([[100.0]]), old_logprobs=torch.zeros(1, 1),
                             advantages=torch.tensor([[-1.0]]), loss_mask=torch.ones(1, 1), plugins=plugins)
    assert loss.item() == approx(math.exp(20), rel=1e-6)  # ρ = exp(20), not inf


def test_ppo_metrics_approx_kl_and_zero_clip_fraction_on_policy(plugins):
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    loss, metrics = policy_loss("ppo", logprobs=logprobs, old_logprobs=torch.tensor([[-1.5, -2.0, -2.0]]),
                                advantages=torch.tensor([[1.0, 1.0, 1.0]]), loss_mask=torch.tensor([[1, 1, 0]]),
                                plugins=plugins)
    # masked mean of old_logprobs - logprobs over the first two tokens: (-0.5 + 0)/2
    assert metrics["policy/approx_kl"].item() == approx(-0.25)
    assert not metrics["policy/approx_kl"].requires_grad
    on_policy, on_metrics = policy_loss("ppo", logprobs=logprobs, old_logprobs=logprobs.detach(),
                                        advantages=torch.ones(1, 3),
                                        loss_mask=torch.ones(1, 3), plugins=plugins)
    assert on_metrics["policy/clip_frac"].item() == 0.0 and on_policy.item() == approx(-1.0)


# --- mismatch correction ---------------------------------------------------------------------

# exp(old_logprobs - rollout_logprobs) = [0.25, 1, 2, 8]; bounds [0.5, 5].
ROLLOUT_RATIO = [0.25, 1.0, 2.0, 8.0]


@pytest.mark.parametrize("correction, weights", [
    ("tis", [0.5, 1.0, 2.0, 5.0]),  # clamped into [0.5, 5]
    ("icepop", [0.0, 1.0, 2.0, 0.0]),  # zero outside [0.5, 5], untouched inside
])
def test_mismatch_correction_weights(plugins, correction, weights):
    old_logprobs = torch.full((1, 4), -1.0)
    rollout_logprobs = old_logprobs - torch.tensor([ROLLOUT_RATIO]).log()
    logprobs = old_logprobs.clone().requires_grad_()  # ρ = 1, Â = 1: ℓ = -w per token
    loss, metrics = policy_loss("ppo", logprobs=logprobs, old_logprobs=old_logprobs, advantages=torch.ones(1, 4),
                                loss_mask=torch.ones(1, 4), rollout_logprobs=rollout_logprobs, correction=correction,
                                correction_bounds=(0.5, 5.0), plugins=plugins)
    assert loss.item() == approx(-sum(weights) / 4, abs=1e-6)
    loss.backward()
    assert logprobs.grad[0].tolist() == approx([-w / 4 for w in weights], abs=1e-6)  # weights are constants
    assert metrics["policy/correction_weight_mean"].item() == approx(sum(weights) / 4, abs=1e-6)
    assert metrics["policy/correction_clip_frac"].item() == 0.5
    # mean of rollout_logprobs - old_logprobs = -mean(log [0.25, 1, 2, 8]) = -log(4)/4
    assert metrics["policy/mismatch_kl"].item() == approx(-math.log(4) / 4, abs=1e-6)


def test_the_correction_bounds_are_inclusive():
    """A ratio exactly at a bound is inside [lo, hi]: icepop keeps it, tis leaves it as it is."""
    from rlhf.plugins.algorithms.policy_losses import correction_weights

    old_logprobs = torch.full((1, 3), -1.0)
    rollout_logprobs = old_logprobs - torch.tensor([[0.5, 1.0, 2.0]]).log()
    ratio = (old_logprobs - rollout_logprobs).exp()  # (1, 3), as the correction computes it
    low, high = float(ratio[0, 0]), float(ratio[0, 2])
    for kind in ("icepop", "tis"):
        weights, outside = correction_weights(old_logprobs, rollout_logprobs, kind=kind, bounds=(low, high))
        assert weights.tolist() == ratio.tolist() and not outside.any(), kind


def test_masked_sums_and_means_over_a_dimension():
    from rlhf.core.masked import masked_mean, masked_sum

    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_sum(x, mask, dim=1).tolist() == [3.0, 0.0]
    assert masked_mean(x, mask, dim=1).tolist() == [1.5, 0.0]  # an empty row's mean is 0
    assert masked_mean(x, mask, dim=0).tolist() == [1.0, 2.0, 0.0]
    assert masked_mean(x, mask).item() == 1.5


# --- loss aggregations on a hand-computed 2×3 example -------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # third row: no action tokens


@pytest.mark.parametrize("aggregation, expected", [
    ("token_mean", (1 + 2 + 4) / 3),
    ("seq_mean_token_mean", ((1 + 2) / 2 + 4 / 1) / 2),
    ("seq_mean_token_sum", ((1 + 2) + 4) / 2),
    ("seq_mean_token_sum_norm", ((1 + 2) / 4 + 4 / 4) / 2),  # max_new_tokens = 4
])
def test_aggregations_hand_computed(plugins, aggregation, expected):
    value = aggregate_loss(aggregation, LOSS, MASK, max_new_tokens=4, plugins=plugins)
    assert value.item() == approx(expected)
    # With step-wide counts the micro-batch returns its share: twice the normaliser, half the value.
    share = aggregate_loss(aggregation, LOSS, MASK, num_tokens=6, num_sequences=4, max_new_tokens=4, plugins=plugins)
    assert share.item() == approx(expected / 2)


def test_seq_mean_token_sum_norm_divides_by_max_new_tokens(plugins):
    loss = torch.ones(2, 5)
    mask = _mask([2, 4], width=5)
    # (2/8 + 4/8)/2 = 0.375, whatever the padded width
    assert aggregate_loss("seq_mean_token_sum_norm", loss, mask, max_new_tokens=8, plugins=plugins).item() == 0.375
    for budget in (None, 0):
        with pytest.raises(Exception, match="max_new_tokens"):
            aggregate_loss("seq_mean_token_sum_norm", loss, mask, max_new_tokens=budget, plugins=plugins)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                         "seq_mean_token_sum_norm"])
def test_a_step_of_one_token_is_that_tokens_loss(plugins, aggregation):
    # one action token of loss 3: every aggregation divides by 1 (token, sequence, budget 1)
    loss = torch.tensor([[3.0, 5.0]])
    value = aggregate_loss(aggregation, loss, torch.tensor([[1.0, 0.0]]), max_new_tokens=1, plugins=plugins)
    assert value.item() == 3.0
    empty = aggregate_loss(aggregation, loss, torch.zeros(1, 2), max_new_tokens=1, plugins=plugins)
    assert empty.item() == 0.0  # no action token: nothing to learn, and no division by zero


def test_policy_loss_uses_the_chosen_aggregation(plugins):
    advantages = torch.tensor([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    logprobs = torch.zeros(2, 3)
    loss, _ = policy_loss("ppo", logprobs=logprobs, old_logprobs=logprobs, advantages=advantages, loss_mask=MASK[:2],
                          aggregation="seq_mean_token_sum_norm", max_new_tokens=4, plugins=plugins)
    assert loss.item() == approx(-((1 + 1) / 4 + 2 / 4) / 2)  # ℓ = -Â at ρ = 1


# --- value loss and entropy ------------------------------------------------------------------

def test_clipped_value_loss(plugins):
    # clip 0.5: token 0: V_clip = 0.5, errors 0.01 vs 0.36 → 0.36
    #           token 1: V_clip = 0.5, errors 2.25 vs 1.00 → 2.25 (clipped term larger)
    #           token 2: V_clip = 2.0 = V, errors 1 vs 1 → 1
    values = torch.tensor([[1.0, 1.0, 2.0]], requires_grad=True)
    kwargs = dict(old_values=torch.tensor([[0.0, 0.0, 1.8]]), returns=torch.tensor([[0.4, 2.0, 3.0]]),
                  loss_mask=torch.ones(1, 3), plugins=plugins)
    loss, metrics = value_loss(values=values, **kwargs)
    assert loss.item() == approx(0.5 * (0.36 + 2.25 + 1.0) / 3, abs=1e-6)
    assert metrics["critic/clip_frac"].item() == approx(1 / 3)
    unclipped, _ = value_loss(values=values, clip=None, **kwargs)
    assert unclipped.item() == approx(0.5 * (0.36 + 1.0 + 1.0) / 3, abs=1e-6)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3)]]])  # p = [1/2, 1/2] and [1/4, 3/4]
    entropy = entropy_from_logits(logits)
    assert entropy[0].tolist() == approx([math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))], abs=1e-6)
    uniform = entropy_from_logits(torch.zeros(2, 3, 4, dtype=torch.bfloat16))
    assert uniform.dtype == torch.float32 and uniform.shape == (2, 3)
    assert uniform.flatten().tolist() == approx([math.log(4)] * 6, abs=1e-6)
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))  # (B, A, V): the sum runs over V
    p = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(dim=-1))


def test_half_precision_log_probs_are_computed_in_float32(plugins):
    logprobs = torch.tensor([[-1.0, -2.5, -0.3]])
    ref = torch.tensor([[-1.2, -2.0, -0.3]])
    for estimator in ("k1", "k2", "k3"):
        full = kl_divergence(estimator, logprobs, ref, plugins=plugins)
        half = kl_divergence(estimator, logprobs.bfloat16(), ref.bfloat16(), plugins=plugins)
        assert half.dtype == torch.float32, estimator
        torch.testing.assert_close(half, kl_divergence(estimator, logprobs.bfloat16().float(), ref.bfloat16().float(),
                                                       plugins=plugins))
        assert full.dtype == torch.float32
