"""Contract of a training backend (``register_train_backends``), on a tiny random Llama.

``backward`` then ``step`` changes the weights and reports finite ``grad_norm``, ``lr`` and
``skipped`` 0, and leaves no gradient behind; a NaN loss makes ``step`` a no-op reported as
``skipped`` 1; ``zero_grad`` drops accumulated gradients; ``state_dict`` survives ``torch.save``
and, loaded into a new backend on the same weights, makes the next step identical to the
original's (the optimizer state is really in it). Backends that shard their state
(``shards_state``) round-trip through ``save_checkpoint`` / ``load_checkpoint`` instead.
"""

from __future__ import annotations

import io
from typing import Any

from rlhf.plugin_kit.checks.target import Target, finite_number, guarded

B, T = 2, 8


def check(target: Target) -> list[str]:
    import torch

    ref = target.tiny_model()
    torch.manual_seed(0)
    batches = [torch.randint(5, 300, (B, T)) for _ in range(3)]  # (B, T) token ids
    model = _load_model(ref)
    backend = _make(target, model)
    lines = []

    before = _weights(backend, model)
    _backward(target, backend, batches[0])
    result = _step(target, backend)
    if result["skipped"] != 0.0:
        raise target.fail(f"step() skipped a step with a finite gradient: {result}")
    if _same(before, _weights(backend, model)):
        raise target.fail("step() did not change the weights after backward(loss); call optimizer.step()")
    _expect_no_gradient(target, backend, model, "after step()")
    lines.append(f"backward + step changes the weights; step() -> grad_norm {result['grad_norm']:.3g}, "
                 f"lr {result['lr']:.3g}, skipped 0; gradients cleared")

    before = _weights(backend, model)
    _backward(target, backend, batches[1], scale=float("nan"))
    result = _step(target, backend)
    if result["skipped"] != 1.0 or not _same(before, _weights(backend, model)):
        raise target.fail(f"a NaN gradient must make step() a no-op reported as skipped 1.0; got {result} and the "
                          f"weights {'unchanged' if _same(before, _weights(backend, model)) else 'changed'}")
    _expect_no_gradient(target, backend, model, "after a skipped step()")
    lines.append("a NaN gradient: step() changes nothing and reports skipped 1.0")

    _backward(target, backend, batches[1])
    guarded(target, "zero_grad()", backend.zero_grad)
    _expect_no_gradient(target, backend, model, "after zero_grad()")
    lines.append("zero_grad() drops accumulated gradients")

    if backend.shards_state:  # a protocol member, checked with the registration
        lines.append(_checkpoint_round_trip(target, backend, model, ref, batches))
    else:
        lines.append(_state_dict_round_trip(target, backend, model, ref, batches))
    return lines


def _state_dict_round_trip(target: Target, backend: Any, model: Any, ref: Any, batches: list[Any]) -> str:
    import torch

    state = guarded(target, "state_dict()", backend.state_dict)
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=False)
    except Exception as exc:
        raise target.fail(f"state_dict() cannot be written with torch.save: {type(exc).__name__}: {exc}") from exc
    twin_model = _load_model(ref)
    twin_model.load_state_dict(_weights(backend, model))
    twin = _make(target, twin_model)
    guarded(target, "load_state_dict()", lambda: twin.load_state_dict(state))
    for b in (backend, twin):
        _backward(target, b, batches[2])
        _step(target, b)
    if not _same(_weights(backend, model), _weights(twin, twin_model)):
        raise target.fail("a new backend given load_state_dict(state_dict()) on the same weights took a different "
                          "next step than the original: state_dict() misses optimizer or schedule state")
    return "state_dict() round trip: torch.save-able, and a restored backend takes the same next step"


def _checkpoint_round_trip(target: Target, backend: Any, model: Any, ref: Any, batches: list[Any]) -> str:
    folder = target.workdir() / "backend-checkpoint"
    guarded(target, "save_checkpoint()", lambda: backend.save_checkpoint(folder))
    twin_model = _load_model(ref)
    twin = _make(target, twin_model)
    guarded(target, "load_checkpoint()", lambda: twin.load_checkpoint(folder))
    for b in (backend, twin):
        _backward(target, b, batches[2])
        _step(target, b)
    if not _same(_weights(backend, model), _weights(twin, twin_model)):
        raise target.fail("a new backend given load_checkpoint(save_checkpoint()) took a different next step than "
                          "the original: the checkpoint misses weights, optimizer or schedule state")
    return "save_checkpoint / load_checkpoint round trip: a restored backend takes the same next step"


def _load_model(ref: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)


def _make(target: Target, model: Any) -> Any:
    config = target.config(lr=1e-2, total_steps=10, micro_batch_size=B)
    return guarded(target, "creating the backend", lambda: target.obj(model, config))


def _backward(target: Target, backend: Any, input_ids: Any, scale: float = 1.0) -> None:
    import torch

    def run() -> None:
        logits = backend.train_module(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                 input_ids[:, 1:].reshape(-1))
        backend.backward(loss * scale)

    guarded(target, "a forward through train_module and backward(loss)", run)


def _step(target: Target, backend: Any) -> dict[str, float]:
    result = guarded(target, "step()", backend.step)
    if not isinstance(result, dict) or not {"grad_norm", "lr", "skipped"} <= set(result):
        raise target.fail(f"step() should return a dict with grad_norm, lr and skipped, got {result!r}")
    if not (finite_number(result["lr"]) and result["skipped"] in (0.0, 1.0)):
        raise target.fail(f"step() returned {result}; lr must be a finite number and skipped 0.0 or 1.0")
    if result["skipped"] == 0.0 and not finite_number(result["grad_norm"]):
        raise target.fail(f"step() reported a non-finite grad_norm for a step it took: {result}")
    return result


def _weights(backend: Any, model: Any) -> dict[str, Any]:
    """The weights of ``model``, which ``backend`` trains in place (``backend_cls(model, config)``)."""
    with backend.full_weights():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _expect_no_gradient(target: Target, backend: Any, model: Any, when: str) -> None:
    left = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() != 0]
    if left:
        raise target.fail(f"gradients are left on {left[0]} (and {len(left) - 1} more) {when}; clear them")



