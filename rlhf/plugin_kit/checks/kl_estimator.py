"""Contract of a KL estimator (``register_kl_estimators``): ``(B, A)``, finite, zero where the
policy equals the reference, differentiable in ``logprobs``, and computed token by token (a
micro-batch split changes nothing)."""

from __future__ import annotations

from rlhf.plugin_kit.checks.target import ContractError, Target, expect_conformance, expect_close, expect_tensor

B, A = 4, 5


def check(target: Target) -> list[str]:
    import torch

    generator = torch.Generator().manual_seed(0)
    ref_logprobs = -torch.rand(B, A, generator=generator) * 3  # (B, A)
    logprobs = (ref_logprobs + torch.randn(B, A, generator=generator) * 0.5).requires_grad_(True)  # (B, A)

    def run(lp, ref, what):
        try:
            return expect_tensor(target, f"the KL ({what})", target.obj(lp, ref), tuple(lp.shape))
        except ContractError:
            raise
        except Exception as exc:
            raise target.fail(f"raised {type(exc).__name__}: {exc} ({what})") from exc

    kl = run(logprobs, ref_logprobs, "random log-probs")
    lines = [f"KL is ({B}, {A}) float and finite"]
    same = run(ref_logprobs, ref_logprobs, "logprobs equal to ref_logprobs")
    if same.abs().max() > 1e-6:
        raise target.fail(f"the KL of a policy equal to its reference should be 0, got up to {same.abs().max().item():.3g}")
    lines.append("zero where logprobs equal ref_logprobs")
    if not kl.requires_grad:
        raise target.fail("the KL does not depend on logprobs (no gradient flows)")
    kl.sum().backward()
    if logprobs.grad is None or not torch.isfinite(logprobs.grad).all():
        raise target.fail("the gradient with respect to logprobs is missing or not finite")
    lines.append("differentiable in logprobs")
    halves = torch.cat([run(logprobs[:2], ref_logprobs[:2], "rows 0-1"), run(logprobs[2:], ref_logprobs[2:], "rows 2-3")])
    expect_close(target, "splitting the rows into two micro-batches changed the KL; compute it token by token",
                 halves.detach(), kl.detach())
    lines.append("micro-batch invariance: two halves give the same KL")
    return lines + expect_conformance(target)
