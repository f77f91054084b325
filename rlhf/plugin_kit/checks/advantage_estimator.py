"""Contract of an advantage estimator (``register_advantage_estimators``).

On a synthetic rollout batch (3 prompts x 4 samples, ragged action masks, random rewards, KL and,
with ``needs_critic``, values): both outputs are ``(B, A)``, finite and zero where
``action_mask`` is 0; a group whose rewards are all equal gives no NaN; swapping two prompts'
groups swaps their rows (the group layout is contiguous rows); a sample left out by
``sample_mask`` gets zeros and changing its reward changes nothing else.
"""

from __future__ import annotations

from typing import Any

from rlhf.plugin_kit.checks.target import (
    Target, expect_conformance, expect_close, expect_tensor, expect_zero_where_masked)

GROUPS, N, A = 3, 4, 6
B = GROUPS * N


def check(target: Target) -> list[str]:
    import torch

    from rlhf.core.types import AdvantageConfig, AdvantageInputs

    config = target.config() or AdvantageConfig()
    needs_critic = bool(target.capabilities.get("needs_critic"))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 3, 1, 5, 2, 6, 4, 1, 3, 6, 2, 5])  # (B,) ragged responses
    action_mask = (torch.arange(A)[None, :] < lengths[:, None]).float()  # (B, A)
    base = dict(
        rewards=torch.rand(B, generator=generator),  # (B,)
        action_mask=action_mask,
        kl=torch.rand(B, A, generator=generator) * 0.1 * action_mask,  # (B, A)
        kl_coef=0.01,
        values=(torch.randn(B, A, generator=generator) * action_mask) if needs_critic else None,
        group_size=N,
    )

    def run(what: str, **changes: Any) -> tuple[Any, Any]:
        inputs = AdvantageInputs(**{**base, **changes})
        try:
            with torch.no_grad():
                result = target.obj(inputs, config)
        except Exception as exc:
            raise target.fail(f"raised {type(exc).__name__}: {exc} ({what})") from exc
        if not (isinstance(result, tuple) and len(result) == 2):
            raise target.fail(f"should return (advantages, returns), got {type(result).__name__} ({what})")
        mask = inputs.action_mask
        outputs = []
        for name, value in zip(("advantages", "returns"), result):
            expect_tensor(target, f"{name} ({what})", value, (B, A))
            expect_zero_where_masked(target, f"{name} ({what})", value, mask, mask_name="action_mask")
            outputs.append(value.float())
        return outputs[0], outputs[1]

    lines = []
    advantages, returns = run("random rewards")
    lines.append(f"advantages and returns are ({B}, {A}) float, finite, zero where action_mask is 0")

    constant = base["rewards"].clone()
    constant[:N] = 0.5  # one group with no reward variance (GRPO's std is 0 there)
    constant[N:2 * N] = 0.0
    run("a group with equal rewards", rewards=constant)
    run("every reward equal", rewards=torch.ones(B))
    lines.append("groups with equal rewards (zero std) give finite outputs")

    order = torch.cat([torch.arange(N, 2 * N), torch.arange(0, N), torch.arange(2 * N, B)])  # swap groups 0 and 1
    swapped = {k: (v[order] if isinstance(v, torch.Tensor) else v) for k, v in base.items()}
    adv_swapped, ret_swapped = run("groups 0 and 1 swapped", **swapped)
    expect_close(target, "swapping two prompts' groups (contiguous blocks of group_size rows) should swap their "
                 "advantages; the estimator does not treat rows [g*n, (g+1)*n) as one group", adv_swapped, advantages[order])
    expect_close(target, "swapping two prompts' groups should swap their returns", ret_swapped, returns[order])
    lines.append("group layout: swapping two prompts' groups swaps their rows")

    sample_mask = torch.ones(B, dtype=torch.bool)
    sample_mask[1] = False
    adv_masked, ret_masked = run("sample 1 left out by sample_mask", sample_mask=sample_mask)
    for name, value in (("advantages", adv_masked), ("returns", ret_masked)):
        if (value[1] != 0).any():
            raise target.fail(f"{name} of a sample left out by sample_mask (False) should be 0, got "
                              f"{value[1].tolist()}")
    changed = base["rewards"].clone()
    changed[1] = 100.0
    adv_changed, _ = run("sample 1 left out, its reward changed", sample_mask=sample_mask, rewards=changed)
    expect_close(target, "the reward of a sample left out by sample_mask changed the other samples' advantages; "
                 "leave it out of group statistics and whitening", adv_changed, adv_masked)
    lines.append("sample_mask: a left-out sample gets zeros and its reward does not reach the others")
    return lines + expect_conformance(target)
