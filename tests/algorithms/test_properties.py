"""Invariances of the algorithm math on random batches (hypothesis), in float64.

Each property would break with a plausible bug: padding leaking into sums, a normaliser taken
per micro-batch, group statistics over the wrong rows, a sign or clamp slip in k3, a clip
fraction counting ties, GAE's recursion off by one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf.algorithms import compute_advantages, kl_divergence, policy_loss
from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.algorithms import oracle

pytestmark = pytest.mark.unit

ESTIMATORS = ("gae", "reinforce_pp", "reinforce_pp_baseline", "rloo", "grpo", "dr_grpo")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PLUGINS = build_plugin_manager(load_entrypoints=False)  # read-only here, shared by the examples


@st.composite
def rollout_batches(draw, min_group: int = 2):
    """A rollout batch: G prompts × n samples, multi-turn masks with holes (some rows empty)."""
    groups = draw(st.integers(1, 3))
    n = draw(st.integers(min_group, 4))
    width = draw(st.integers(1, 7))
    batch = groups * n
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    binary = draw(st.booleans())
    rewards = (torch.rand(batch, generator=generator, dtype=torch.float64) < 0.5).double() if binary else \
        torch.randn(batch, generator=generator, dtype=torch.float64) * 3
    mask = (torch.rand(batch, width, generator=generator) < 0.7).double()  # (B, A)
    values = torch.randn(batch, width, generator=generator, dtype=torch.float64)
    kl = torch.randn(batch, width, generator=generator, dtype=torch.float64) * 0.1
    return {"rewards": rewards, "action_mask": mask, "values": values, "kl": kl, "group_size": n}


def _advantages(estimator: str, batch: dict, **kwargs):
    return compute_advantages(estimator, rewards=batch["rewards"], action_mask=batch["action_mask"],
                              group_size=batch["group_size"], values=batch["values"], kl=batch["kl"],
                              plugins=PLUGINS, **kwargs)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@PROPERTY_SETTINGS
@given(batch=rollout_batches(), beta=st.sampled_from([0.0, 0.05]), gamma=st.sampled_from([1.0, 0.9]),
       lambd=st.sampled_from([1.0, 0.7]), std_norm=st.booleans(), clip=st.sampled_from([10.0, 0.5, None]))
def test_estimators_agree_with_the_loop_oracle(estimator, batch, beta, gamma, lambd, std_norm, clip):
    kwargs = dict(kl_coef=beta, gamma=gamma, lambd=lambd, std_norm=std_norm, reward_clip=clip)
    if gamma != 1.0 and estimator in oracle.GROUP:
        with pytest.warns(UserWarning, match="always uses gamma = 1"):
            advantages, returns = _advantages(estimator, batch, **kwargs)
    else:
        advantages, returns = _advantages(estimator, batch, **kwargs)
    expected_adv, expected_ret = oracle.advantages(
        estimator, batch["rewards"].tolist(), batch["action_mask"].int().tolist(), batch["group_size"],
        values=batch["values"].tolist(), kl=batch["kl"].tolist(), beta=beta, gamma=gamma, lambd=lambd,
        std_norm=std_norm, clip=clip)
    torch.testing.assert_close(advantages, torch.tensor(expected_adv, dtype=torch.float64), atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(returns, torch.tensor(expected_ret, dtype=torch.float64), atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@PROPERTY_SETTINGS
@given(batch=rollout_batches(), left=st.integers(0, 3), right=st.integers(0, 3), beta=st.sampled_from([0.0, 0.1]))
def test_padding_with_masked_positions_changes_nothing(estimator, batch, left, right, beta):
    advantages, returns = _advantages(estimator, batch, kl_coef=beta)

    def pad(tensor, fill):
        rows = tensor.size(0)
        return torch.cat([torch.full((rows, left), fill, dtype=tensor.dtype), tensor,
                          torch.full((rows, right), fill, dtype=tensor.dtype)], dim=1)

    padded = dict(batch, action_mask=pad(batch["action_mask"], 0.0), values=pad(batch["values"], 123.0),
                  kl=pad(batch["kl"], float("nan")))  # garbage where the mask is 0
    padded_advantages, padded_returns = _advantages(estimator, padded, kl_coef=beta)
    width = batch["action_mask"].size(1)
    torch.testing.assert_close(padded_advantages[:, left:left + width], advantages, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(padded_returns[:, left:left + width], returns, atol=1e-12, rtol=1e-10)
    assert not padded_advantages[:, :left].any() and not padded_advantages[:, left + width:].any()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@PROPERTY_SETTINGS
@given(batch=rollout_batches(min_group=1), left=st.integers(0, 3), right=st.integers(0, 3))
def test_policy_loss_ignores_masked_padding(aggregation, batch, left, right):
    mask = batch["action_mask"]
    old_logprobs = -batch["values"].abs()
    logprobs = (old_logprobs + batch["kl"]).requires_grad_()
    loss, _ = policy_loss("ppo", logprobs=logprobs, old_logprobs=old_logprobs, advantages=batch["values"],
                          loss_mask=mask,
                          aggregation=aggregation, max_new_tokens=16, plugins=PLUGINS)

    def pad(tensor, fill):
        rows = tensor.size(0)
        return torch.cat([torch.full((rows, left), fill, dtype=tensor.dtype), tensor,
                          torch.full((rows, right), fill, dtype=tensor.dtype)], dim=1)

    padded_loss, _ = policy_loss("ppo", logprobs=pad(logprobs.detach(), -5.0), old_logprobs=pad(old_logprobs, 3.0),
                                 advantages=pad(batch["values"], 50.0), loss_mask=pad(mask, 0.0),
                                 aggregation=aggregation, max_new_tokens=16, plugins=PLUGINS)
    torch.testing.assert_close(padded_loss, loss.detach(), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@PROPERTY_SETTINGS
@given(batch=rollout_batches(min_group=1), cuts=st.lists(st.integers(1, 11), max_size=3),
       dual_clip=st.sampled_from([None, 3.0]))
def test_micro_batch_split_gives_the_same_gradient(aggregation, batch, cuts, dual_clip):
    mask, advantages = batch["action_mask"], batch["values"]
    old_logprobs = -batch["values"].abs()
    batch_size = mask.size(0)
    bounds = sorted({0, batch_size, *[c for c in cuts if c < batch_size]})
    kwargs = dict(aggregation=aggregation, max_new_tokens=16, dual_clip=dual_clip, plugins=PLUGINS)

    whole = (old_logprobs + batch["kl"] * 5).requires_grad_()
    loss, _ = policy_loss("ppo", logprobs=whole, old_logprobs=old_logprobs, advantages=advantages, loss_mask=mask,
                          **kwargs)
    loss.backward()

    split = (old_logprobs + batch["kl"] * 5).requires_grad_()
    num_tokens = float(mask.sum())
    num_sequences = float((mask.sum(dim=-1) > 0).sum())
    total = torch.zeros((), dtype=torch.float64)
    for start, stop in zip(bounds, bounds[1:]):  # one backward per micro-batch, as in training
        part, _ = policy_loss("ppo", logprobs=split[start:stop], old_logprobs=old_logprobs[start:stop],
                              advantages=advantages[start:stop], loss_mask=mask[start:stop],
                              num_tokens=num_tokens, num_sequences=num_sequences, **kwargs)
        part.backward()
        total += part.detach()
    torch.testing.assert_close(total, loss.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(split.grad, whole.grad, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@PROPERTY_SETTINGS
@given(batch=rollout_batches(), seed=st.integers(0, 1000))
def test_permuting_whole_groups_permutes_the_advantages(estimator, batch, seed):
    n = batch["group_size"]
    groups = batch["rewards"].numel() // n
    order = torch.randperm(groups, generator=torch.Generator().manual_seed(seed))
    rows = (order[:, None] * n + torch.arange(n)[None, :]).reshape(-1)  # whole groups move, in order
    advantages, returns = _advantages(estimator, batch, kl_coef=0.05)
    permuted = {key: value[rows] if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    permuted_advantages, permuted_returns = _advantages(estimator, permuted, kl_coef=0.05)
    torch.testing.assert_close(permuted_advantages, advantages[rows], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(permuted_returns, returns[rows], atol=1e-12, rtol=1e-10)


@PROPERTY_SETTINGS
@given(batch=rollout_batches())
def test_grpo_advantages_of_a_group_sum_to_zero(batch):
    mask = torch.ones_like(batch["action_mask"])
    advantages, _ = compute_advantages("grpo", rewards=batch["rewards"], action_mask=mask,
                                       group_size=batch["group_size"], plugins=PLUGINS)
    per_group = advantages[:, 0].view(-1, batch["group_size"]).sum(dim=-1)  # (G,)
    torch.testing.assert_close(per_group, torch.zeros_like(per_group), atol=1e-6, rtol=0)


@PROPERTY_SETTINGS
@given(logprobs=st.lists(st.floats(-30, 0), min_size=1, max_size=20), shift=st.floats(-15, 15))
def test_k3_is_never_negative(logprobs, shift):
    logprobs = torch.tensor([logprobs], dtype=torch.float64)
    ref_logprobs = (logprobs + shift).clamp(max=0)
    for dtype in (torch.float64, torch.float32):
        assert (kl_divergence("k3", logprobs.to(dtype), ref_logprobs.to(dtype), plugins=PLUGINS) >= 0).all()


@PROPERTY_SETTINGS
@given(batch=rollout_batches(min_group=1), clip_low=st.floats(0.0, 0.5), clip_high=st.floats(0.0, 0.5))
def test_clip_fraction_is_zero_when_the_ratio_is_one(batch, clip_low, clip_high):
    logprobs = -batch["values"].abs()
    _, metrics = policy_loss("ppo", logprobs=logprobs, old_logprobs=logprobs.clone(), advantages=batch["values"] * 10,
                             loss_mask=batch["action_mask"], clip_low=clip_low, clip_high=clip_high,
                             dual_clip=2.0, plugins=PLUGINS)
    assert metrics["policy/clip_frac"].item() == 0.0
    assert metrics["policy/dual_clip_frac"].item() == 0.0
    assert metrics["policy/approx_kl"].item() == 0.0


@PROPERTY_SETTINGS
@given(batch=rollout_batches(min_group=1), beta=st.sampled_from([0.0, 0.2]))
def test_gae_with_unit_gamma_lambda_and_zero_values_is_the_reward_to_go(batch, beta):
    mask = batch["action_mask"]
    zeros = torch.zeros_like(batch["values"])
    advantages, returns = compute_advantages("gae", rewards=batch["rewards"], action_mask=mask, values=zeros,
                                             kl=batch["kl"], kl_coef=beta, group_size=batch["group_size"],
                                             std_norm=False, plugins=PLUGINS)
    # Reward-to-go by hand: Σ_{k ≥ t} R_k with R = -β·kl on action tokens + r on the last one.
    rewards = torch.where(mask.bool(), -beta * batch["kl"], torch.zeros_like(mask))  # (B, A)
    for row in range(mask.size(0)):
        positions = mask[row].nonzero().flatten()
        if len(positions):
            rewards[row, positions[-1]] += batch["rewards"][row].clamp(-10, 10)
    to_go = rewards.flip(1).cumsum(1).flip(1) * mask  # (B, A)
    torch.testing.assert_close(returns, to_go, atol=1e-12, rtol=1e-10)
    whitened_mean = (to_go * mask).sum() / mask.sum().clamp(min=1)
    torch.testing.assert_close(advantages, (to_go - whitened_mean) * mask, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("estimator", ("rloo", "grpo", "dr_grpo", "reinforce_pp_baseline"))
@PROPERTY_SETTINGS
@given(batch=rollout_batches())
def test_an_all_valid_sample_mask_changes_nothing(estimator, batch):
    advantages, returns = _advantages(estimator, batch)
    valid = torch.ones_like(batch["rewards"], dtype=torch.bool)
    masked_advantages, masked_returns = _advantages(estimator, batch, sample_mask=valid)
    assert torch.equal(masked_advantages, advantages) and torch.equal(masked_returns, returns)
