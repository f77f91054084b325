"""The offline losses of rlhf.objectives on hand-computed examples (the derivation above each).

Each function also equals OpenRLHF's loss class of the same purpose on random inputs; that was
checked against OpenRLHF's own code outside this repository (worst absolute difference 2.4e-7 in
200 random trials per loss), and these examples pin the same formulas here.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.objectives import (distillation_loss, dpo_loss, kto_loss, prm_loss, reward_model_loss, sequence_logprobs,
                             sft_loss)

pytestmark = pytest.mark.unit

approx = pytest.approx


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_sft_loss_is_the_next_token_cross_entropy_over_labelled_positions():
    # V = 2. Position 0 predicts token 1 with logits [0, 0] (p = 1/2); position 1 predicts token 2 with
    # logits [0, ln 3] (p(1) = 3/4); position 2 predicts nothing. Labels: token 1 ignored (-100), token 2 = 1.
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3)], [5.0, -5.0]]])  # (1, 3, 2)
    labels = torch.tensor([[7, -100, 1]])
    assert sft_loss(logits, labels).item() == approx(-math.log(0.75), abs=1e-6)  # only position 1 counts
    both = torch.tensor([[7, 0, 1]])  # position 0 predicts 0 with p 1/2
    assert sft_loss(logits, both).item() == approx((math.log(2) - math.log(0.75)) / 2, abs=1e-6)


def test_dpo_cdpo_and_ipo():
    # h = (log π_c − log π_r) − (log ref_c − log ref_r) = (−1 + 2) − (−1.5 + 1.5) = 1, β = 0.1
    args = [torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5])]
    loss, chosen, rejected = dpo_loss(*args, beta=0.1)
    assert loss.item() == approx(softplus(-0.1), abs=1e-6)  # −log σ(0.1)
    assert chosen.tolist() == approx([0.05]) and rejected.tolist() == approx([-0.05])  # β(log π − log ref)
    smoothed, _, _ = dpo_loss(*args, beta=0.1, label_smoothing=0.2)
    assert smoothed.item() == approx(0.8 * softplus(-0.1) + 0.2 * softplus(0.1), abs=1e-6)
    ipo, _, _ = dpo_loss(*args, beta=0.1, ipo=True)
    assert ipo.item() == approx((1 - 1 / (2 * 0.1)) ** 2, abs=1e-5)  # (h − 1/(2β))² = 16
    two, _, _ = dpo_loss(*(torch.cat([a, a + 1]) for a in args), beta=0.1)
    assert two.item() == approx(softplus(-0.1), abs=1e-6)  # a mean over pairs (both pairs have h = 1)


def test_dpo_implicit_rewards_carry_no_gradient_and_the_loss_does():
    policy_chosen = torch.tensor([-1.0], requires_grad=True)
    loss, chosen, _ = dpo_loss(policy_chosen, torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5]))
    loss.backward()
    assert not chosen.requires_grad
    assert policy_chosen.grad.item() == approx(-0.1 * sigmoid(-0.1), abs=1e-6)  # d/dh −log σ(βh) = −β σ(−βh)


def test_reward_model_losses():
    chosen, rejected = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 2.0])
    assert reward_model_loss(chosen, rejected).item() == approx((softplus(-1) + math.log(2)) / 2, abs=1e-6)
    margin = torch.tensor([0.5, 0.0])
    assert reward_model_loss(chosen, rejected, margin=margin).item() == approx((softplus(-0.5) + math.log(2)) / 2,
                                                                               abs=1e-6)
    assert reward_model_loss(chosen, rejected, kind="logexp").item() == approx((softplus(-1) + math.log(2)) / 2,
                                                                               abs=1e-6)
    # logexp takes no margin, as OpenRLHF's LogExpLoss; it does not overflow for large gaps
    assert reward_model_loss(chosen, rejected, kind="logexp", margin=margin).item() == \
        reward_model_loss(chosen, rejected, kind="logexp").item()
    assert reward_model_loss(torch.tensor([0.0]), torch.tensor([200.0]), kind="logexp").item() == approx(200.0)
    with pytest.raises(ValueError, match="sigmoid, logexp"):
        reward_model_loss(chosen, rejected, kind="hinge")


def test_kto_with_a_kl_reference_point_and_weights():
    # β = 1; z = max(0, mean([0.3, 0.1] − [0, 0])) = 0.2; desirable log-ratio 1, undesirable −1
    args = [torch.tensor([1.0]), torch.tensor([-1.0]), torch.tensor([0.3, 0.1]),
            torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0, 0.0])]
    loss, chosen, rejected, z = kto_loss(*args, beta=1.0)
    desirable, undesirable = 1 - sigmoid(1 - 0.2), 1 - sigmoid(0.2 + 1)
    assert z.item() == approx(0.2) and chosen.tolist() == [1.0] and rejected.tolist() == [-1.0]
    assert loss.item() == approx((desirable + undesirable) / 2, abs=1e-6)
    weighted, *_ = kto_loss(*args, beta=1.0, desirable_weight=2.0, undesirable_weight=0.5)
    assert weighted.item() == approx((2 * desirable + 0.5 * undesirable) / 2, abs=1e-6)
    only_desirable, _, none, _ = kto_loss(args[0], torch.tensor([]), args[2], args[3], torch.tensor([]), args[5],
                                          beta=1.0)
    assert only_desirable.item() == approx(desirable, abs=1e-6) and none.numel() == 0
    _, _, _, clamped = kto_loss(*args[:2], torch.tensor([-1.0]), *args[3:5], torch.tensor([0.0]), beta=1.0)
    assert clamped.item() == 0.0  # the reference point is never negative


def test_distillation_is_the_cross_entropy_to_the_teachers_distribution():
    # teacher p = [1/2, 1/2], student q = [1/4, 3/4]: −Σ p log q = (ln 4 + ln 4/3) / 2
    teacher = torch.tensor([[[0.0, 0.0], [9.0, 0.0]]])  # (1, 2, 2); the second position is masked out
    student = torch.tensor([[[0.0, math.log(3)], [0.0, 0.0]]])
    mask = torch.tensor([[1, 0]])
    assert distillation_loss(student, teacher, mask).item() == approx((math.log(4) + math.log(4 / 3)) / 2, abs=1e-6)
    # a vocabulary entry the student rules out (−inf) contributes nothing instead of NaN
    ruled_out = torch.tensor([[[0.0, float("-inf")], [0.0, 0.0]]])
    assert distillation_loss(ruled_out, teacher, mask).item() == approx(0.0, abs=1e-6)


def test_prm_loss_hard_and_soft_labels():
    placeholder, plus, minus = 9, 3, 4
    input_ids = torch.tensor([[1, 9, 2, 9]])  # two steps, each followed by the placeholder
    logits = torch.zeros(1, 4, 6)
    logits[0, 1, plus] = math.log(3)  # step 1: p(+) = 3/4 among {+, −}
    logits[0, 3, minus] = math.log(3)  # step 2: p(−) = 3/4
    hard = torch.tensor([[-100, plus, -100, plus]])
    loss, accuracy = prm_loss(input_ids, logits, hard, placeholder_token_id=placeholder, reward_token_ids=[plus, minus])
    assert loss.item() == approx((-math.log(0.75) - math.log(0.25)) / 2, abs=1e-6)
    assert accuracy.item() == 0.5
    soft = torch.tensor([[-100.0, 0.5, -100.0, 1.0]])  # the probability of "+"
    loss, accuracy = prm_loss(input_ids, logits, soft, placeholder_token_id=placeholder, reward_token_ids=[plus, minus])
    assert loss.item() == approx((-(0.5 * math.log(0.75) + 0.5 * math.log(0.25)) - math.log(0.25)) / 2, abs=1e-6)
    assert accuracy.item() == 0.5  # argmax of [0.5, 0.5] is "+"; of [1, 0] is "+"
    whole_vocab, _ = prm_loss(input_ids, logits, hard, placeholder_token_id=placeholder, reward_token_ids=None)
    assert whole_vocab.item() == approx((-math.log(3 / 8) - math.log(1 / 8)) / 2, abs=1e-6)  # softmax over 6 tokens


def test_sequence_logprobs_sum_and_mean_over_the_mask():
    logprobs = torch.tensor([[-1.0, -2.0, -4.0], [-3.0, 0.0, 0.0]])
    sums, means = sequence_logprobs(logprobs, torch.tensor([[0, 1, 1], [0, 0, 0]]))
    assert sums.tolist() == [-6.0, 0.0] and means.tolist() == [-3.0, 0.0]


def test_sequence_logprobs_of_a_single_learnt_token_is_that_token():
    sums, means = sequence_logprobs(torch.tensor([[-1.0, -2.5, -4.0]]), torch.tensor([[0, 1, 0]]))
    assert sums.tolist() == [-2.5] and means.tolist() == [-2.5]


def test_prm_loss_ignores_a_placeholder_labelled_minus_100():
    placeholder, plus, minus = 9, 3, 4
    input_ids = torch.tensor([[1, 9, 2, 9]])
    logits = torch.zeros(1, 4, 6)
    logits[0, 1, plus] = math.log(3)  # step 1: p(+) = 3/4 among {+, −}
    labels = torch.tensor([[-100, plus, -100, -100]])  # step 2 has no label (e.g. cut by --max-len)
    loss, _ = prm_loss(input_ids, logits, labels, placeholder_token_id=placeholder, reward_token_ids=[plus, minus])
    assert loss.item() == approx(-math.log(0.75), abs=1e-6)


def test_kto_rewards_carry_no_gradient():
    policy = torch.tensor([1.0], requires_grad=True)
    _, chosen, rejected, _ = kto_loss(policy, policy * 2, torch.tensor([0.3]), torch.tensor([0.0]), torch.tensor([0.0]),
                                      torch.tensor([0.0]), beta=1.0)
    assert not chosen.requires_grad and not rejected.requires_grad


def test_distillation_of_bf16_logits_is_computed_in_float32():
    generator = torch.Generator().manual_seed(0)
    student = (torch.randn(2, 5, 64, generator=generator) * 3).bfloat16()  # (B, T, V)
    teacher = (torch.randn(2, 5, 64, generator=generator) * 3).bfloat16()
    mask = torch.ones(2, 5)
    p = teacher.double().softmax(-1)  # the same bf16 values, in float64
    expected = -(p * student.double().log_softmax(-1)).sum(-1).mean()
    assert distillation_loss(student, teacher, mask).item() == approx(expected.item(), rel=2e-6)
