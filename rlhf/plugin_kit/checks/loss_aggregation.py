"""Contract of a loss aggregation (``register_loss_aggregations``): a finite scalar, differentiable,
blind to masked positions, and the promise of the kind: with the step's ``LossNorm``, the sum
over the micro-batches of a step equals the whole step's loss, however the step is split."""

from __future__ import annotations

from rlhf.plugin_kit.checks.target import Target, expect_close, expect_conformance

B, A = 6, 5


def check(target: Target) -> list[str]:
    import torch

    from rlhf.core.types import LossNorm

    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 2, 4, 1, 5, 3])
    loss_mask = (torch.arange(A)[None, :] < lengths[:, None]).float()  # (B, A)
    loss = (torch.randn(B, A, generator=generator) * loss_mask).requires_grad_(True)  # (B, A)
    norm = LossNorm(num_tokens=float(loss_mask.sum()), num_sequences=float((loss_mask.sum(1) > 0).sum()),
                    max_new_tokens=A)

    def run(values, mask, what):
        try:
            out = target.obj(values, mask, norm)
        except Exception as exc:
            raise target.fail(f"raised {type(exc).__name__}: {exc} ({what})") from exc
        if not isinstance(out, torch.Tensor) or out.numel() != 1 or out.dim() != 0:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise target.fail(f"should return a scalar tensor (shape ()), got {shape} ({what})")
        if not torch.isfinite(out):
            raise target.fail(f"returned {out.item()} ({what})")
        return out

    whole = run(loss, loss_mask, "the whole step")
    lines = ["returns a finite scalar tensor"]
    if not whole.requires_grad:
        raise target.fail("the result does not depend on the loss (no gradient flows)")
    whole.backward()
    if loss.grad is None or not (loss.grad != 0).any():
        raise target.fail("no gradient reaches the per-token loss")
    lines.append("differentiable")
    noisy = loss.detach() + (1 - loss_mask) * 1e3  # garbage at masked positions
    expect_close(target, "values at masked positions (loss_mask 0) changed the result; mask them out",
                 run(noisy, loss_mask, "garbage at masked positions").detach(), whole.detach(), atol=1e-4)
    lines.append("masked positions are ignored")
    for split in ((3, 3), (1, 2, 3), (5, 1)):
        parts, start = [], 0
        for size in split:
            parts.append(run(loss.detach()[start:start + size], loss_mask[start:start + size], f"micro-batch of {size}"))
            start += size
        expect_close(target, f"the micro-batch losses of a step split {list(split)} do not add up to the whole "
                     "step's loss; divide by the step counts in `norm`, not by this micro-batch's",
                     torch.stack(parts).sum(), whole.detach())
    lines.append("micro-batch invariance: splits [3, 3], [1, 2, 3], [5, 1] add up to the whole step")
    return lines + expect_conformance(target)
