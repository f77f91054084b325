"""Every built-in term of the policy loss, in one file; the formula that combines them is the host's
(rlhf/algorithms/training_loss.py):

    L = agg(ℓ) + β·agg(clamp(kl(logprobs, ref_logprobs), ±10)) − c·agg(H)

1. The settings (``--policy-loss.<name>``): `PPOLossConfig` of the ``ppo`` and ``gspo`` losses
   (``--clip-low`` / ``--clip-high`` / ``--dual-clip`` for short), `CISPOLossConfig` of ``cispo``
   (``--clip-low`` / ``--clip-high``), `SAPOLossConfig` of ``sapo`` (``--tau-pos`` / ``--tau-neg``).
2. The policy losses ℓ (``--policy-loss``): ``ppo`` (one ratio per token) and ``gspo`` (one ratio
   per sequence), which hand their ratio ρ to `clipped_surrogate`, the clip they share
   (asymmetric ranges, dual clip); ``cispo`` (the policy gradient weighted by the clipped,
   gradient-stopped ratio) and ``sapo`` (a soft sigmoid gate of the ratio instead of the clip).
   `policy_metrics` gives them the same metrics. Another loss is a function
   ``(PolicyLossInputs, config) -> (ℓ (B, A), metrics)`` here and one ``register(...)`` line in
   ``plugin.py``.
3. `correction_weights`: the rollout/trainer mismatch corrections ``tis``, ``icepop``,
   ``seq_mask_tis`` (``ppo``, ``cispo`` and ``sapo`` weigh their ℓ with them, `corrected`).
4. The KL estimators kl (``--kl-estimator``): ``k1``, ``k2``, ``k3``. The host clamps every
   estimate to [-10, 10] and masks it; ``--kl-unbiased-gradient`` keeps an estimator's value and
   gives it the importance-weighted gradient of the reverse KL. Both apply to any estimator, a
   third party's too, so they are the host's (``clamped_kl`` in training_loss.py).
5. The loss aggregations agg (``--loss-agg``): ``token_mean``, ``seq_mean_token_mean``,
   ``seq_mean_token_sum``, ``seq_mean_token_sum_norm``.

Each is registered by ``plugin.py`` as a ``"module:attr"`` reference, as a third party would. No
torch at import: the command line reads `PPOLossConfig` for ``--help``, so the functions import
torch when they run.

Every tensor is ``(B, A)`` unless said otherwise; ``loss_mask`` (float 0/1) marks the action tokens
of the samples that count. Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhf.api import RlhfError

if TYPE_CHECKING:
    import torch

    from rlhf.api import LossNorm, PolicyLossInputs

__all__ = ["CISPOLossConfig", "CORRECTIONS", "LOG_RATIO_CLAMP", "PPOLossConfig", "SAPOLossConfig",
           "cispo_policy_loss", "clipped_surrogate", "corrected", "correction_weights", "gspo_policy_loss", "k1", "k2", "k3", "log_ratio", "policy_metrics", "ppo_policy_loss",
           "sapo_policy_loss", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_mean"]


# --- 1. settings ----------------------------------------------------------------------------------

CORRECTIONS = ("tis", "icepop", "seq_mask_tis")  # rollout/trainer mismatch corrections (section 3)


def _correction_field() -> Any:
    return field(default=None, metadata={
        "help": "rollout/trainer mismatch correction: 'tis' (clamped weight), 'icepop' (weight 0 "
                "outside the bounds) or 'seq_mask_tis' (drop a sequence whose geometric-mean weight leaves "
                "the bounds); needs the rollout engine's log-probs; None: off"})


def _correction_bounds_field() -> Any:
    return field(default=(0.5, 5.0), metadata={
        "range": "[0, inf)", "help": "[lo, hi] for the correction weight exp(old_logprobs - rollout_logprobs)"})


def _check_correction(config: Any) -> None:
    """Normalise and check a config's ``correction`` and ``correction_bounds`` (every loss that
    applies the mismatch corrections has both)."""
    if isinstance(config.correction, str):
        config.correction = config.correction.replace("-", "_")  # OpenRLHF spells it seq-mask-tis
    if config.correction is not None and config.correction not in CORRECTIONS:
        raise RlhfError(f"unknown mismatch correction {config.correction!r}; choose one of "
                        f"{', '.join(CORRECTIONS)} (or None)")
    low, high = config.correction_bounds
    if not 0 <= low <= high:
        raise RlhfError(f"correction_bounds must satisfy 0 <= lo <= hi, got {config.correction_bounds}")


@dataclass(kw_only=True)
class PPOLossConfig:
    """Settings of the ``ppo`` and ``gspo`` policy losses."""

    clip_low: float = field(default=0.2, metadata={"help": "ε_low: the ratio is clipped below at 1 - ε_low",
                                                   "range": "[0, 1)"})
    clip_high: float = field(default=0.2, metadata={
        "range": "[0, inf)", "help": "ε_high: the ratio is clipped above at 1 + ε_high (larger than ε_low: DAPO's clip-higher)"})
    dual_clip: float | None = field(default=None, metadata={
        "range": "(1, inf)", "help": "c > 1: for negative advantages the loss is at most -c·Â (dual-clip PPO); None: off"})
    correction: str | None = _correction_field()
    correction_bounds: tuple[float, float] = _correction_bounds_field()

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1 or not self.clip_high >= 0:
            raise RlhfError(f"ppo clip ranges need 0 <= clip_low < 1 and clip_high >= 0, "
                            f"got clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise RlhfError(f"dual_clip must be greater than 1 (or None to turn it off), got {self.dual_clip}")
        _check_correction(self)


@dataclass(kw_only=True)
class CISPOLossConfig:
    """Settings of the ``cispo`` policy loss: the bounds of its importance-sampling weight."""

    clip_low: float = field(default=1.0, metadata={"range": "[0, inf)",
        "help": "ε_low: the IS weight is clipped below at 1 - ε_low; 1 or more: no lower bound (MiniMax-M1)"})
    clip_high: float = field(default=0.2, metadata={"range": "[0, inf)",
        "help": "ε_high: the IS weight is clipped above at 1 + ε_high (verl's CISPO example: 0.2)"})
    correction: str | None = _correction_field()
    correction_bounds: tuple[float, float] = _correction_bounds_field()

    def __post_init__(self) -> None:
        if not self.clip_low >= 0 or not self.clip_high >= 0:
            raise RlhfError(f"cispo clip ranges need clip_low >= 0 and clip_high >= 0, "
                            f"got clip_low={self.clip_low}, clip_high={self.clip_high}")
        _check_correction(self)


@dataclass(kw_only=True)
class SAPOLossConfig:
    """Settings of the ``sapo`` policy loss: the temperatures of its soft gate."""

    tau_pos: float = field(default=1.0, metadata={"range": "(0, inf)",
        "help": "τ_pos > 0: the gate's temperature on tokens with a positive advantage (larger: a sharper gate)"})
    tau_neg: float = field(default=1.05, metadata={"range": "(0, inf)",
        "help": "τ_neg > 0: the gate's temperature on tokens with an advantage <= 0 (the paper: a little "
                "above τ_pos, negative updates are damped faster)"})
    correction: str | None = _correction_field()
    correction_bounds: tuple[float, float] = _correction_bounds_field()

    def __post_init__(self) -> None:
        if not self.tau_pos > 0 or not self.tau_neg > 0:
            raise RlhfError(f"sapo temperatures must be positive, got tau_pos={self.tau_pos}, tau_neg={self.tau_neg}")
        _check_correction(self)


# --- 2. policy losses ℓ -----------------------------------------------------------------------------

LOG_RATIO_CLAMP = 20.0  # ppo clamps its log-ratio to ±20 before exp, so a stale token cannot overflow


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor,
                      config: PPOLossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The clipped surrogate objective J (to maximise; ℓ = -J), shared by the ratio-clipping losses.

        J = min(ρ Â, clip(ρ, 1 - ε_low, 1 + ε_high) Â)                     (Schulman et al. 2017, eq. 7)
        dual clip c > 1, where Â < 0:  J = max(J, c Â)             (Ye et al. 2020, arXiv:1912.09729)

    ε_high > ε_low is DAPO's clip-higher (arXiv:2503.14476): unlikely tokens may grow more. The
    dual clip bounds the loss of a negative-advantage token whose ratio is very large.
    ratio, advantages (B, A). Returns ``(J (B, A), clipped (B, A), dual_clipped (B, A) or None)``:
    1.0 where the clipped term is the smaller one (in the ratio's dtype), and where the dual
    clip acted (bool; None without dual clip).
    """
    import torch

    surrogate = ratio * advantages  # (B, A)
    clipped_surrogate = ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * advantages  # (B, A)
    objective = torch.min(surrogate, clipped_surrogate)  # (B, A)
    clipped = (clipped_surrogate < surrogate).to(ratio.dtype)  # (B, A)
    if config.dual_clip is None:
        return objective, clipped, None
    floor = config.dual_clip * advantages  # (B, A)
    dual_clipped = (advantages < 0) & (floor > objective)  # (B, A)
    return torch.where(advantages < 0, torch.max(objective, floor), objective), clipped, dual_clipped


def policy_metrics(inputs: PolicyLossInputs, log_ratio: torch.Tensor, clipped: torch.Tensor | None,
                   dual_clipped: torch.Tensor | None,
                   correction: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The metrics of a policy loss (detached scalars, means over the loss mask):

    ``policy/dual_clip_frac`` (with dual clip), ``policy/mismatch_kl`` = mean(rollout_logprobs -
    old_logprobs) (with rollout log-probs), the ``correction`` metrics, ``policy/clip_frac``
    (share of tokens where the clip acted; not for a loss without a clip, clipped None) and
    ``policy/approx_kl`` = mean(old_logprobs - logprobs), the k1 estimate of KL(old ‖ new).
    log_ratio = logprobs - old_logprobs, clipped (B, A) in the ratio's dtype, dual_clipped (B, A) bool.
    """
    from rlhf.api import masked_mean

    loss_mask = inputs.loss_mask
    metrics: dict[str, torch.Tensor] = {}
    if dual_clipped is not None:
        metrics["policy/dual_clip_frac"] = masked_mean(dual_clipped.to(clipped.dtype), loss_mask).detach()
    if inputs.rollout_logprobs is not None:
        metrics["policy/mismatch_kl"] = masked_mean(inputs.rollout_logprobs - inputs.old_logprobs,
                                                    loss_mask).detach()
    metrics.update(correction or {})
    if clipped is not None:
        metrics["policy/clip_frac"] = masked_mean(clipped, loss_mask).detach()
    metrics["policy/approx_kl"] = masked_mean(-log_ratio.detach(), loss_mask)
    return metrics


def _rollout_logprobs(inputs: PolicyLossInputs, config: Any) -> torch.Tensor:
    """The rollout engine's log-probs a mismatch correction needs (an error when there are none)."""
    if inputs.rollout_logprobs is None:
        raise RlhfError(
            f"the {config.correction!r} mismatch correction needs the rollout engine's log-probs, and "
            "none were given: use an engine that returns them, or turn the correction off"
        )
    return inputs.rollout_logprobs


def corrected(loss: torch.Tensor, inputs: PolicyLossInputs,
              config: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """ℓ weighed by the mismatch correction of ``config`` (``config.correction``, ``.correction_bounds``):
    ℓ_t ← w_t ℓ_t with w detached (`correction_weights`); unchanged when the correction is off.

    loss (B, A). Returns ``(ℓ (B, A), metrics)``: ``policy/correction_weight_mean`` and
    ``policy/correction_clip_frac`` with a correction, None without.
    """
    from rlhf.api import masked_mean

    if config.correction is None:
        return loss, None
    loss_mask = inputs.loss_mask
    weights, outside = correction_weights(inputs.old_logprobs, _rollout_logprobs(inputs, config),
                                          kind=config.correction, bounds=config.correction_bounds,
                                          loss_mask=loss_mask)  # (B, A) each
    metrics = {"policy/correction_weight_mean": masked_mean(weights, loss_mask).detach(),
               "policy/correction_clip_frac": masked_mean(outside.to(weights.dtype), loss_mask).detach()}
    return weights.to(loss.dtype) * loss, metrics  # (B, A)


def ppo_policy_loss(inputs: PolicyLossInputs,
                    config: PPOLossConfig | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347), as OpenRLHF:

        ρ_t = exp(clamp(logprobs_t - old_logprobs_t, -20, 20))
        ℓ_t = -J(ρ_t, Â_t)                                   (`clipped_surrogate`: clip, dual clip)
        with a mismatch correction:  ℓ_t ← w_t ℓ_t          (`correction_weights`, w detached)

    inputs.logprobs (B, A) with grad; old_logprobs, advantages, loss_mask, rollout_logprobs (B, A).
    Returns ``(ℓ (B, A), 0 off the loss mask; metrics)`` (`policy_metrics`, plus
    ``policy/correction_weight_mean`` and ``policy/correction_clip_frac`` with a correction).
    """
    from rlhf.api import masked

    config = config or PPOLossConfig()
    log_ratio = inputs.logprobs - inputs.old_logprobs  # (B, A)
    ratio = log_ratio.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP).exp()  # (B, A)
    objective, clipped, dual_clipped = clipped_surrogate(ratio, inputs.advantages, config)  # (B, A) each
    loss, correction = corrected(-objective, inputs, config)  # (B, A)
    return masked(loss, inputs.loss_mask), policy_metrics(inputs, log_ratio, clipped, dual_clipped, correction)


def gspo_policy_loss(inputs: PolicyLossInputs,
                     config: PPOLossConfig | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071), as OpenRLHF's
    ``PolicyLoss(policy_loss_type="gspo")``: one ratio per sequence, the geometric mean of its
    token ratios (not clamped), clipped like ppo's:

        s_i    = exp(Σ_t (logprobs_{i,t} - old_logprobs_{i,t}) m_{i,t} / max(Σ_t m_{i,t}, 1))
        ℓ_{i,t} = -J(s_i, Â_{i,t})  on the loss tokens          (`clipped_surrogate`: clip, dual clip)

    The ratio is the sequence's, its gradient reaches every token through the mean log-ratio. With
    a mismatch correction set (any kind), s_i is taken against the rollout log-probs instead of the
    old ones and no weight is applied (OpenRLHF's behaviour). The registration declares
    ``aggregation="seq_mean_token_mean"``: this term is always a mean per sequence, whatever
    ``--loss-agg`` says (the KL and entropy terms keep the run's).

    inputs.logprobs (B, A) with grad; old_logprobs, advantages, loss_mask, rollout_logprobs (B, A).
    Returns ``(ℓ (B, A), 0 off the loss mask; metrics)`` (`policy_metrics`; its approx_kl is on
    the old log-probs).
    """
    from rlhf.api import masked, masked_sum

    config = config or PPOLossConfig()
    loss_mask = inputs.loss_mask
    log_ratio = inputs.logprobs - inputs.old_logprobs  # (B, A)
    sequence_log_ratio = log_ratio  # (B, A)
    if config.correction is not None:
        sequence_log_ratio = inputs.logprobs - _rollout_logprobs(inputs, config)  # (B, A)
    tokens = loss_mask.sum(dim=-1).clamp(min=1)  # (B,)
    sequence_ratio = (masked_sum(sequence_log_ratio, loss_mask, dim=-1) / tokens).exp()  # (B,)
    ratio = sequence_ratio[:, None] * loss_mask  # (B, A), 0 off the mask
    objective, clipped, dual_clipped = clipped_surrogate(ratio, inputs.advantages, config)  # (B, A) each
    return masked(-objective, loss_mask), policy_metrics(inputs, log_ratio, clipped, dual_clipped)


def cispo_policy_loss(inputs: PolicyLossInputs,
                      config: CISPOLossConfig | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", arXiv:2506.13585), as verl's ``compute_policy_loss_cispo``: the REINFORCE
    gradient of every token, weighted by its importance ratio clipped and gradient-stopped:

        ρ_t = exp(clamp(logprobs_t - old_logprobs_t, -20, 20))
        ℓ_t = -sg(clip(ρ_t, 1 - ε_low, 1 + ε_high)) · Â_t · logprobs_t,   ∇ℓ_t = -sg(·) Â_t ∇logprobs_t
        with a mismatch correction:  ℓ_t ← w_t ℓ_t          (`corrected`, w detached)

    Unlike ppo's clip, the clip here bounds the weight and never drops a token's gradient: the rare
    tokens a ppo clip zeroes after the first update ("However", "Wait") keep theirs. The paper
    normalises by the tokens of the whole batch (``token_mean``, the ``cispo`` preset's).
    Deviations: the paper sets no lower bound ("ε_low large"): the default ε_low = 1 makes the
    bound 0, the same thing. TRL's ``loss_type="cispo"`` clamps only above, at ε_max (its
    ``epsilon_high``, a ratio, not 1 + ε), and does not clamp the log-ratio: set ε_low = 1 and
    ε_high = ε_max - 1 for its values (they differ only where |log ρ| > 20). ℓ's value is the
    anchors' -w·Â·logprobs: a surrogate whose gradient is the method, not an objective value.

    inputs.logprobs (B, A) with grad; old_logprobs, advantages, loss_mask, rollout_logprobs (B, A).
    Returns ``(ℓ (B, A), 0 off the loss mask; metrics)`` (`policy_metrics`: clip_frac is the share
    of tokens whose weight was clipped).
    """
    from rlhf.api import masked

    config = config or CISPOLossConfig()
    log_ratio = inputs.logprobs - inputs.old_logprobs  # (B, A)
    ratio = log_ratio.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP).exp()  # (B, A)
    weight = ratio.clamp(min=1 - config.clip_low, max=1 + config.clip_high).detach()  # (B, A) sg(clip(ρ))
    clipped = (weight != ratio.detach()).to(ratio.dtype)  # (B, A)
    loss, correction = corrected(-weight * inputs.advantages * inputs.logprobs, inputs, config)  # (B, A)
    return masked(loss, inputs.loss_mask), policy_metrics(inputs, log_ratio, clipped, None, correction)


def sapo_policy_loss(inputs: PolicyLossInputs,
                     config: SAPOLossConfig | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Qwen team 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347), as verl's
    ``compute_policy_loss_sapo`` and TRL's ``loss_type="sapo"``: a smooth, temperature-controlled
    gate of the token ratio instead of ppo's hard clip:

        ρ_t = exp(clamp(logprobs_t - old_logprobs_t, -20, 20))
        τ_t = τ_pos if Â_t > 0 else τ_neg
        f(ρ, τ) = σ(τ (ρ - 1)) · 4 / τ
        ℓ_t = -f(ρ_t, τ_t) · Â_t,      ∇ℓ_t = -4 σ_t (1 - σ_t) ρ_t · Â_t ∇logprobs_t
        with a mismatch correction:  ℓ_t ← w_t ℓ_t          (`corrected`, w detached)

    On-policy (ρ = 1) the gradient weight 4σ(1-σ)ρ is 1, the policy gradient; it decays smoothly as
    ρ leaves 1, faster for larger τ, so far-off-policy tokens fade out instead of being cut. τ_neg >
    τ_pos (1.05 and 1.0 in the paper) damps negative updates faster, which the paper finds stabler.
    The registration declares ``aggregation="seq_mean_token_mean"`` (the paper's per-sequence mean,
    which verl hard-codes for SAPO and TRL uses): whatever ``--loss-agg`` says for the KL and
    entropy terms. Deviation: TRL does not clamp the log-ratio (the values differ only where
    |log ρ| > 20, where the gate's gradient is below 1e-8 anyway).

    inputs.logprobs (B, A) with grad; old_logprobs, advantages, loss_mask, rollout_logprobs (B, A).
    Returns ``(ℓ (B, A), 0 off the loss mask; metrics)``: `policy_metrics` (no clip_frac) and
    ``policy/gate_weight``, the mean gradient weight 4σ(1-σ)ρ (1 on-policy).
    """
    import torch

    from rlhf.api import masked, masked_mean

    config = config or SAPOLossConfig()
    log_ratio = inputs.logprobs - inputs.old_logprobs  # (B, A)
    ratio = log_ratio.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP).exp()  # (B, A)
    tau = torch.where(inputs.advantages > 0, torch.full_like(ratio, config.tau_pos),
                      torch.full_like(ratio, config.tau_neg))  # (B, A) τ_t
    gate = torch.sigmoid(tau * (ratio - 1))  # (B, A) σ
    loss, correction = corrected(-gate * (4 / tau) * inputs.advantages, inputs, config)  # (B, A)
    metrics = policy_metrics(inputs, log_ratio, None, None, correction)
    gate = gate.detach()
    metrics["policy/gate_weight"] = masked_mean(4 * gate * (1 - gate) * ratio.detach(), inputs.loss_mask)
    return masked(loss, inputs.loss_mask), metrics


# --- 3. mismatch corrections ------------------------------------------------------------------------


def correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *, kind: str,
                       bounds: tuple[float, float],
                       loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached weights for the mismatch between the rollout engine and the trainer.

    The rollout engine (vLLM, or another kernel) samples with log-probs rollout_logprobs that
    differ slightly from the trainer's recomputation old_logprobs of the same policy, so the
    samples are a little off-policy. With δ_roll = old_logprobs - rollout_logprobs and bounds
    [lo, hi] (OpenRLHF's defaults 0.5, 5.0):

    - ``tis`` (truncated importance sampling; Yao et al. 2025, "Your Efficient RL Framework
      Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl):
      w = clamp(exp(δ_roll), lo, hi);
    - ``icepop`` (token masking; IcePop, from inclusionAI's Ring-1T report, 2025):
      w = exp(δ_roll) when lo ≤ exp(δ_roll) ≤ hi, else 0;
    - ``seq_mask_tis`` (sequence masking, OpenRLHF's ``seq-mask-tis``): a sequence whose geometric
      mean weight exp(Σ_t δ_roll m / Σ_t m) leaves [lo, hi] is dropped (w = 0 on all its
      tokens); the tokens of the others keep their own unclamped weight w = exp(δ_roll). Needs
      ``loss_mask``.

    old_logprobs, rollout_logprobs, loss_mask (B, A). Returns ``(w (B, A), outside (B, A) bool)``:
    where the bounds acted (for seq_mask_tis, every token of a dropped sequence).
    """
    import torch

    from rlhf.api import as_float, masked_mean

    assert kind in CORRECTIONS, f"unknown mismatch correction {kind!r}; choose one of {', '.join(CORRECTIONS)}"
    assert old_logprobs.shape == rollout_logprobs.shape, (
        f"old_logprobs {tuple(old_logprobs.shape)} and rollout_logprobs {tuple(rollout_logprobs.shape)} differ"
    )
    low, high = bounds
    ratio = (as_float(old_logprobs) - as_float(rollout_logprobs)).detach().exp()  # (B, A)
    outside = (ratio < low) | (ratio > high)  # (B, A)
    if kind == "seq_mask_tis":
        assert loss_mask is not None, "seq_mask_tis needs the loss mask"
        log_ratio = as_float(old_logprobs) - as_float(rollout_logprobs)  # (B, A)
        sequence_ratio = masked_mean(log_ratio, loss_mask, dim=-1).exp()  # (B,) geometric mean
        dropped = (sequence_ratio < low) | (sequence_ratio > high)  # (B,)
        outside = dropped[:, None].expand_as(ratio)  # (B, A)
        return torch.where(outside, torch.zeros_like(ratio), ratio).detach(), outside
    if kind == "tis":
        weights = ratio.clamp(min=low, max=high)  # (B, A)
    else:
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)  # (B, A)
    return weights, outside


# --- 4. KL estimators kl ----------------------------------------------------------------------------
#
# Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), on the
# sampled tokens with δ = logprobs - ref_logprobs (samples come from the policy). The functions see
# raw log-probs; half precision is computed in float32 (float64 stays float64). Deviation from
# OpenRLHF: k3 is clamped at 0 from below (for tiny δ, rounding in exp(-δ) - 1 + δ can give -1e-17
# although the exact value is >= 0; elsewhere the results are equal).


def log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """δ = logprobs - ref_logprobs. (B, A)"""
    from rlhf.api import as_float

    assert logprobs.shape == ref_logprobs.shape, (
        f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ"
    )
    return as_float(logprobs) - as_float(ref_logprobs)  # (B, A)


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = δ (Schulman 2020): unbiased, may be negative; the default for KL in the reward. (B, A)"""
    return log_ratio(logprobs, ref_logprobs)  # (B, A)


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = δ²/2 (Schulman 2020): biased, non-negative; its gradient matches k1's in expectation near
    δ = 0. (B, A)"""
    return log_ratio(logprobs, ref_logprobs).pow(2) / 2.0  # (B, A)


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(-δ) - 1 + δ (Schulman 2020): unbiased, non-negative, low variance; GRPO's KL loss
    (Shao et al. 2024, arXiv:2402.03300). (B, A)"""
    delta = log_ratio(logprobs, ref_logprobs)  # (B, A)
    return ((-delta).exp() - 1 + delta).clamp(min=0)  # (B, A); the clamp only undoes rounding


# --- 5. loss aggregations agg -----------------------------------------------------------------------
#
# How a per-token loss ℓ (B, A) becomes the scalar that is differentiated. Each returns one
# micro-batch's share of the optimizer step's loss, normalised by counts over the whole step
# (``LossNorm``: all micro-batches and data-parallel ranks), so the shares sum to the step loss and
# the gradient does not depend on how the step is split. N_seq counts the sequences with at least
# one loss token; a sequence without any contributes 0.


def _at_least_one(count: Any) -> Any:
    """A step normaliser that is never 0 (a step without loss tokens has a zero numerator)."""
    import torch

    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def token_mean(loss: torch.Tensor, loss_mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """Σ_{i,t} ℓ m / N_tokens: every loss token weighs the same (DAPO, arXiv:2503.14476; OpenRLHF since
    2026-06). loss, loss_mask (B, A) -> ()"""
    from rlhf.api import masked_sum

    return masked_sum(loss, loss_mask) / _at_least_one(norm.num_tokens)


def seq_mean_token_mean(loss: torch.Tensor, loss_mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """Σ_i (Σ_t ℓ m / Σ_t m) / N_seq: every sequence weighs the same, tokens within it equally (the GRPO
    paper's form, Shao et al. 2024, arXiv:2402.03300). loss, loss_mask (B, A) -> ()"""
    from rlhf.api import masked_sum

    tokens_per_sequence = loss_mask.bool().sum(dim=-1).clamp(min=1).to(loss.dtype)  # (B,)
    per_sequence = masked_sum(loss, loss_mask, dim=-1) / tokens_per_sequence  # (B,)
    return per_sequence.sum() / _at_least_one(norm.num_sequences)


def seq_mean_token_sum(loss: torch.Tensor, loss_mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """Σ_i Σ_t ℓ m / N_seq: long sequences weigh more. loss, loss_mask (B, A) -> ()"""
    from rlhf.api import masked_sum

    return masked_sum(loss, loss_mask) / _at_least_one(norm.num_sequences)


def seq_mean_token_sum_norm(loss: torch.Tensor, loss_mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """Σ_i (Σ_t ℓ m / L_max) / N_seq, L_max = max new tokens: a constant per-token weight, free of length
    bias (Dr. GRPO, arXiv:2503.20783). loss, loss_mask (B, A) -> ()"""
    from rlhf.api import masked_sum

    if norm.max_new_tokens is None or norm.max_new_tokens <= 0:
        raise RlhfError(
            "loss aggregation 'seq_mean_token_sum_norm' divides by the generation budget: pass "
            f"max_new_tokens (a positive number of tokens), got {norm.max_new_tokens!r}"
        )
    per_sequence = masked_sum(loss, loss_mask, dim=-1) / norm.max_new_tokens  # (B,)
    return per_sequence.sum() / _at_least_one(norm.num_sequences)
