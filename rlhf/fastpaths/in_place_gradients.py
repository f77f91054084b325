"""The vocabulary-sized gradients added into ``.grad`` where they are computed, not handed to autograd.

A backward normally returns each parameter's gradient to autograd, which adds it to ``.grad``
once the parameter's last use is done. For a language model's input embedding and output layer
at a real vocabulary that gradient is a (V, H) tensor, 311 MB of float32 at Qwen2's V = 151,936
and H = 512: the embedding's backward writes a dense (V, H) of zeros plus the rows its tokens use,
the tiled log-probs (`rlhf.fastpaths.vocab_chunks`) a dense (V, H) summed over their tiles, and
with tied weights (one tensor for both, as small models have) autograd holds both at once, beside
``.grad``, until it has added them: 622 MB above the training state at that vocabulary, the
largest part of a step's peak memory there.

Here, while a training backend's optimizer step runs its forwards and backwards
(`accumulating_in_place`, which the ``torch`` backend enters through
`TrainBackendBase.accumulating`; DeepSpeed, which hooks gradients as autograd hands them over,
does not), the two backwards add their part into the weight's ``.grad`` themselves and hand
autograd nothing for the weight:

* the output layer's tiles (`vocab_chunks`), a (b, H) block of ∂W at a time:
  ``.grad[v0:v1] += −qᵀ·(g_ℓ·h) / τ``, then ``.grad += onehot`` rows, as the module docstring there
  writes them;
* the embedding, only the rows its tokens use: ∂E_k = Σ_{i: x_i = k} ∂e_i summed first in the
  order of the tokens (as ``embedding_dense_backward`` sums them), then ``.grad[k] += ∂E_k``.

The output layer's known-gradient forward (`vocab_chunks`, where the loss's gradient is known
before it) adds its ∂W into ``.grad`` during the forward itself, which is why the window spans the
step's forwards and not only its backwards.

Memory: no (V, H) temporary at all. Numbers: the same terms; where autograd added ``.grad +
(tiles + embedding)``, they are now added one after the other, ``(.grad + tiles) + embedding``
(float rounding; an untied embedding's gradient is added exactly as autograd adds it, bit for
bit). Taken for a float32 weight that is a leaf, whose ``.grad`` is float32 on its device; never
in a backward outside a backend's (a user's own ``loss.backward()`` gets the gradients handed
over, as always). The first backward of each model in place is compared with the plain one
(`rlhf.fastpaths.verdicts`, paths ``in_place_gradients/embedding`` and ``/head``): the output
layer's sum in place (into a new ``.grad``, or beside it) against the tiles' dense one, the
embedding's rows against ``embedding_dense_backward``'s (V, H) gradient (its rows no token uses
must be zeros); where they differ, that backward and every later one hand autograd the plain
gradient. Switch: ``--no-in-place-gradients``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from rlhf.core.modeling import innermost
from rlhf.fastpaths.verdicts import settle, verdict

ALLOWED = "_rlhf_in_place_gradients"  # set on a weight (the model adapter's switch) that may be accumulated in place
TOLERANCE = 1e-5  # float32 rounding of a sum of a few terms, relative to the gradient's largest entry
_LOCK = threading.Lock()
_ACCUMULATING: dict[int, int] = {}  # id(parameter) -> how many backends' backwards hold it in place now
_SCRATCH: dict[tuple[Any, ...], torch.Tensor] = {}  # (thread, width, dtype, device) -> a buffer held while a window lasts


def in_place_capable(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The ones of ``params`` that may take their gradients in place (`use_in_place_gradients` gave
    them the ability): what a backend hands `accumulating_in_place`, none with the switch off."""
    return [p for p in params if getattr(p, ALLOWED, False)]


@contextlib.contextmanager
def accumulating_in_place(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """While this lasts, the allowed ones of ``params`` take their vocabulary-sized gradients in
    place (a backend wraps its ``loss.backward()`` in it). A global table, not the calling
    thread's: on a GPU autograd runs a backward on threads of its own."""
    ids = [id(p) for p in in_place_capable(params)]
    with _LOCK:
        for key in ids:
            _ACCUMULATING[key] = _ACCUMULATING.get(key, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            for key in ids:
                _ACCUMULATING[key] -= 1
                if not _ACCUMULATING[key]:
                    del _ACCUMULATING[key]
            if not _ACCUMULATING:
                _SCRATCH.clear()  # the step's scratch buffers go with its last window


def step_scratch(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (rows, width) tensor to compute in, its contents undefined. While a backend's optimizer
    step holds a window open (`accumulating_in_place`), the calling thread gets the same buffer back
    for each width, dtype and device (the most rows asked for so far), freed when the last window
    closes: a step's micro-batches then reuse one block instead of each mapping a fresh one, which
    the kernel page-faults in (glibc maps blocks from rlhf's 1 MiB threshold on a large model;
    the known-gradient output layer's (c, V) logits are 155 MB at Qwen2's vocabulary, 38,000
    faults a micro-batch). Outside a window: a fresh tensor."""
    if not _ACCUMULATING:
        return torch.empty((rows, width), dtype=dtype, device=device)
    key = (threading.get_ident(), width, dtype, torch.device(device))
    with _LOCK:
        held = _SCRATCH.get(key)
        if held is None or held.shape[0] < rows:
            _SCRATCH.pop(key, None)  # the smaller one goes before the larger is made
            held = _SCRATCH[key] = torch.empty((rows, width), dtype=dtype, device=device)
    return held[:rows]


def in_place(weight: torch.Tensor, owner: nn.Module, part: str) -> bool:
    """Whether this backward adds ``weight``'s gradient into its ``.grad`` itself (``owner``'s
    verdict on ``part`` not against it)."""
    if id(weight) not in _ACCUMULATING or not weight.is_leaf or weight.dtype != torch.float32:
        return False
    grad = weight.grad
    if grad is not None and (grad.dtype != torch.float32 or grad.device != weight.device
                             or grad.shape != weight.shape or grad.layout != torch.strided):
        return False
    return verdict(owner, f"in_place_gradients/{part}") is not False


def grad_of(weight: torch.Tensor) -> torch.Tensor:
    """``weight.grad``, made (zeros) where the backward is the first to add to it."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    return weight.grad


def largest(tensor: torch.Tensor) -> float:
    """max |tensor| (0 for an empty one), with no temporary of its size."""
    return float(torch.linalg.vector_norm(tensor, float("inf"))) if tensor.numel() else 0.0


def largest_difference(a: torch.Tensor, b: torch.Tensor, rows: int = 4096) -> float:
    """max |a − b| over two (V, H) tensors, ``rows`` rows at a time (no third (V, H) tensor)."""
    return max((largest(a[r:r + rows] - b[r:r + rows]) for r in range(0, a.shape[0], rows)), default=0.0)


def settle_first(owner: nn.Module, part: str, difference: float, scale: float) -> bool:
    """The first in-place backward of ``owner``'s ``part``: ``difference``, the largest between what
    it added and the gradient autograd would have been handed, relative to that gradient's largest
    entry ``scale``."""
    return settle(owner, f"in_place_gradients/{part}", difference / max(scale, 1e-30), TOLERANCE,
                  who="in-place gradients", switch="--no-in-place-gradients")


def row_sums(ids: torch.Tensor, rows: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tokens used (U,), their summed rows (U, H)): each token's rows summed in their order (as
    the embedding's dense backward sums them), none for ``padding_idx``. ids (N,), rows (N, H)."""
    if padding_idx is not None:
        keep = ids != padding_idx  # (N,)
        ids, rows = ids[keep], rows[keep]
    used, where = torch.unique(ids, return_inverse=True)  # (U,), (N,)
    summed = torch.zeros(used.numel(), rows.shape[1], dtype=torch.float32, device=rows.device)  # (U, H)
    summed.index_add_(0, where, rows.float())  # serial in the order of the tokens
    return used, summed


def add_rows(grad: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, padding_idx: int | None) -> None:
    """``grad[k] += Σ_{i: ids_i = k} rows_i`` (`row_sums`)."""
    used, summed = row_sums(ids, rows, padding_idx)
    if used.numel():
        grad.index_add_(0, used, summed)


class _EmbeddingRows(torch.autograd.Function):
    """F.embedding(ids, E), whose backward adds its rows into ``E.grad`` in a backend's backward (the
    module docstring), and hands autograd the dense gradient anywhere else."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None,
                owner: nn.Module) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.owner, ctx.weight, ctx.rows = padding_idx, owner, weight, weight.shape[0]
        return nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        flat_ids, rows = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])  # (N,), (N, H)
        weight, owner = ctx.weight, ctx.owner

        def plain() -> torch.Tensor:  # (V, H) what F.embedding's backward hands autograd
            padding = -1 if ctx.padding_idx is None else ctx.padding_idx
            return torch.ops.aten.embedding_dense_backward(grad_out, ids, ctx.rows, padding, False)

        if not in_place(weight, owner, "embedding"):
            return None, plain(), None, None
        if verdict(owner, "in_place_gradients/embedding") is None:  # the rows against the dense gradient
            dense = plain()  # (V, H)
            used, summed = row_sums(flat_ids, rows, ctx.padding_idx)  # (U,), (U, H)
            scale, at_rows = largest(dense), largest(dense.index_select(0, used) - summed)
            elsewhere = largest(dense.index_fill_(0, used, 0.0))  # rows no token uses: zeros in both
            if not settle_first(owner, "embedding", max(at_rows, elsewhere), scale):
                return None, plain(), None, None
        add_rows(grad_of(weight), flat_ids, rows, ctx.padding_idx)
        return None, None, None, None


class _InPlaceEmbedding:
    """Mixed in after an ``nn.Embedding`` (`use_in_place_embedding`): its forward through `_EmbeddingRows`
    where the weight trains."""

    __slots__ = ()

    def _rows_forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad and getattr(self.weight, ALLOWED, False):
            return _EmbeddingRows.apply(ids, self.weight, self.padding_idx, self)
        return nn.Embedding.forward(self, ids)


@functools.cache
def _in_place_class(cls: type) -> type:
    return type(f"InPlace{cls.__name__}", (cls, _InPlaceEmbedding), {
        "__module__": __name__, "forward": _InPlaceEmbedding._rows_forward})


def use_in_place_gradients(model: nn.Module) -> list[str]:
    """Let ``model``'s input embedding and output layer add their gradients in place (in a backend's
    backward): the embedding where it is a plain ``nn.Embedding`` (no ``max_norm``, frequency
    scaling or sparse gradients), the output layer where it takes tiled log-probs
    (`rlhf.fastpaths.vocab_chunks`); returns which of ``embedding``/``head`` it did."""
    from rlhf.core.logprobs import DeferredHead

    base = innermost(model)
    done = []
    embedding, head = _module(base, "get_input_embeddings"), _module(base, "get_output_embeddings")
    if (isinstance(embedding, nn.Embedding) and type(embedding).forward is nn.Embedding.forward
            and embedding.max_norm is None
            and not embedding.scale_grad_by_freq and not embedding.sparse):
        embedding.__class__ = _in_place_class(type(embedding))
        setattr(embedding.weight, ALLOWED, True)
        done.append("embedding")
    elif isinstance(embedding, _InPlaceEmbedding):
        done.append("embedding")
    if isinstance(head, DeferredHead) and isinstance(getattr(head, "weight", None), torch.Tensor):
        setattr(head.weight, ALLOWED, True)
        done.append("head")
    return done


def _module(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` or the like; None where the model has none."""
    get = getattr(model, getter, None)
    try:
        return get() if callable(get) else None
    except NotImplementedError:  # transformers' default for a model that does not say
        return None
