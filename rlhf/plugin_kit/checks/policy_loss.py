"""Contract of a policy loss (``register_policy_losses``).

On synthetic micro-batches: the per-token loss is ``(B, A)``, finite, zero where ``loss_mask`` is
0 and differentiable in ``logprobs`` (finite gradient, not all zero); metrics are finite scalars;
and each row's loss depends only on its own row, so splitting a batch into micro-batches gives the
same per-token losses (the host's aggregation then makes the step independent of the split).
"""

from __future__ import annotations

from typing import Any

from rlhf.plugin_kit.checks.target import (
    Target, expect_conformance, expect_close, expect_tensor, expect_zero_where_masked, finite_number)

B, A = 6, 5


def check(target: Target) -> list[str]:
    import torch

    from rlhf.core.types import PolicyLossInputs

    config = target.config()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 2, 4, 1, 5, 3])
    loss_mask = (torch.arange(A)[None, :] < lengths[:, None]).float()  # (B, A)
    old_logprobs = -torch.rand(B, A, generator=generator) * 2  # (B, A)
    logprobs = old_logprobs + torch.randn(B, A, generator=generator) * 0.3  # (B, A) ratios around 1, some clipped
    advantages = torch.randn(B, A, generator=generator)  # (B, A), not masked: the loss must mask itself
    rollout_logprobs = old_logprobs + torch.randn(B, A, generator=generator) * 0.05  # (B, A)

    def run(rows: slice) -> tuple[Any, Any, dict]:
        current = logprobs[rows].clone().requires_grad_(True)
        inputs = PolicyLossInputs(logprobs=current, old_logprobs=old_logprobs[rows], advantages=advantages[rows],
                                  loss_mask=loss_mask[rows], rollout_logprobs=rollout_logprobs[rows])
        try:
            result = target.obj(inputs, config)
        except Exception as exc:
            raise target.fail(f"raised {type(exc).__name__}: {exc}") from exc
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
            raise target.fail(f"should return (per_token_loss, metrics dict), got {type(result).__name__}")
        loss, metrics = result
        n = rows.stop - rows.start
        expect_tensor(target, "the per-token loss", loss, (n, A))
        expect_zero_where_masked(target, "the per-token loss", loss.detach(), loss_mask[rows], mask_name="loss_mask")
        return current, loss, metrics

    lines = []
    current, loss, metrics = run(slice(0, B))
    for key, value in metrics.items():
        number = value.item() if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1 else value
        if not finite_number(number):
            raise target.fail(f"metric {key!r} should be a finite scalar, got {value!r}")
        if hasattr(value, "requires_grad") and value.requires_grad:
            raise target.fail(f"metric {key!r} should be detached (it requires grad)")
    lines.append(f"per-token loss is ({B}, {A}), finite, zero where loss_mask is 0; "
                 f"{len(metrics)} finite metric(s)")
    if not loss.requires_grad:
        raise target.fail("the loss does not depend on inputs.logprobs (no gradient flows)")
    (loss * loss_mask).sum().backward()
    grad = current.grad
    if grad is None or not torch.isfinite(grad).all() or not (grad != 0).any():
        raise target.fail(f"the gradient with respect to logprobs should be finite and not all zero, got {grad}")
    lines.append("differentiable: a finite, non-zero gradient reaches logprobs")

    halves = [run(slice(0, B // 2))[1], run(slice(B // 2, B))[1]]
    expect_close(target, "splitting the batch into two micro-batches changed the per-token losses; a row's loss "
                 "must depend only on that row", torch.cat(halves).detach(), loss.detach())
    lines.append("micro-batch invariance: two halves give the same per-token losses as the whole batch")
    return lines + expect_conformance(target)
