"""Log-probs from the final hidden states, the vocabulary projected a tile at a time.

The plain path projects every scored position to the vocabulary at once: (K, V) float32 logits,
their log-softmax, and in the backward as many again for their gradient. At Qwen2's vocabulary
(V = 151,936) that is 0.6 MB a position, 1.5 GB for a micro-batch of 8 x 320 tokens. Here the
model's output layer hands back its input, the hidden states h (K, H), and the log-probs are
computed from them tile by tile: up to `TILE_POSITIONS` positions x a block of b =
``TILE_ELEMENTS / positions`` vocabulary entries (on a CPU 512 x 256, 512 KB of float32: a tile
stays in a core's L2 cache while it is exponentiated and summed; on a GPU 4096 positions and 32 MB,
the sizes from before that change, unmeasured there), each block's max and sum kept, merged at the end:

    z   = (h·W_bᵀ + b_b) / τ                  (c, b) float32, one tile at a time
    ℓ_k = z_k[y_k] − logsumexp(z_k)           the log-prob of the target y_k
    H_k = logsumexp(z_k) − Σ_v p_kv z_kv      the entropy, p = softmax(z)

Only logsumexp(z) (K,) is kept for the backward, which recomputes each tile's z. With
∂z = (g_ℓ·onehot(y) − q) / τ and q = g_ℓ·p + g_H·p·(log p + H) (the entropy term only when the
entropy has a gradient), the onehot part is applied once, outside the tiles, and without the
entropy g_ℓ scales the (c, H) operands instead of the tile (the tile is only exp(z − lse), in place):

    ∂h   = (g_ℓ·W_y − Σ_blocks q_b·W_b) / τ        q_b = g_ℓ·p_b: ∂h = g_ℓ·(W_y − Σ p_b·W_b) / τ
    ∂W_b = −q_bᵀ·h / τ,   ∂W_y += g_ℓ·h / τ        q_b = g_ℓ·p_b: ∂W_b = −p_bᵀ·(g_ℓ·h) / τ
    ∂b_b = −Σ_k q_kb / τ, ∂b_y += g_ℓ / τ

(a block of the weight's gradient is written by the first chunk of positions and summed into by
the others). Memory is O(c·b) instead of O(K·V), for one more product with W than the plain path
(four instead of three); the tiles' other work is a few passes over data in cache, where the plain
path's log-softmax and its gradient pass over (K, V) in memory. The numbers are the plain path's up
to float rounding. What that costs in CPU time, against the full logits (a whole policy update, and
the output layer alone): benchmarks/README.md, "Memory at a real vocabulary".
A call still takes the full logits while they stay small (`FULL_LOGITS_UP_TO`, 64 MiB: a
micro-batch of 8 x 64 tokens at a 32k vocabulary), with or without a backward: a policy and its
reference then score a micro-batch the same way. Distillation's cross-entropy to a teacher's
distribution (`rlhf.objectives.distillation_loss`) runs the same way, the teacher's logits
z' = h'_c·W'ᵀ (+ b') recomputed beside the student's, in chunks of c = ``CHUNK_ELEMENTS / V``
positions:

    c_k  = −Σ_v q_kv·f_kv·log p_kv            q = softmax(z'), f = [z_kv finite]
    ∂z   = g_c·(p·Σ_v q·f − q·f)

**The loss's gradient known before the forward.** The fourth product is there because the
backward needs p, which needs logsumexp over the whole vocabulary, and the forward cannot keep
(K, V) logits. Where the gradient g_ℓ = ∂L/∂ℓ is known before the forward, the backward can run
inside it instead: on-policy without a KL or entropy term the ratio exp(ℓ − sg(ℓ)) is exactly 1
whatever ℓ is, so g_ℓ is the advantage over the step's token counts. The policy update asks the
loss for it (`rlhf.algorithms.PolicyTrainingLoss.logprob_gradient`: the gradient at two stand-in
values of ℓ, kept where the two are equal to the bit) and passes it down
(`rlhf.core.logprobs.known_logprob_gradient`); `_KnownGradientLogprobs` then takes c =
``KNOWN_GRADIENT_ELEMENTS / V`` positions at a time at most (276 at Qwen2's vocabulary, 168 MB of
float32 logits; a call's chunks of equal size) with the whole vocabulary's logits at once:

    z = h_c·Wᵀ / τ,  ℓ = z[y] − logsumexp(z),  p = softmax(z)        (c, V), one product
    ∂h_c = g·(W_y − p·W) / τ                                         one product, kept for the backward
    .grad(W) += −pᵀ·(g·h_c) / τ,  then += g·h / τ at rows y           one product, in the forward

three products with W instead of four. ∂W goes into the weight's ``.grad`` during the forward, so
the path runs only inside a backend's optimizer step that lets it (`TrainBackendBase.accumulating`,
the torch backend's; `rlhf.fastpaths.in_place_gradients`), without a bias or entropy, with a gradient to follow (the forward of a policy
update, never a no-grad forward). The backward checks that the gradient it is handed equals the
announced one, bit for bit; any other (a loss whose gradient follows ℓ only outside the two
stand-ins) is exact all the same: ∂h and ∂W are linear in g, so the difference goes through the
tiles' backward and is added. The first such call of a model compares ℓ, ∂h and ∂W with the tiles'
on its first 64 positions and 4,096 vocabulary entries (path ``vocab_chunks/known_gradient``).
Measured at Qwen2's vocabulary, 512 positions, one thread: 2.04 s against the tiles' 2.66 s; a
whole GRPO step 0.86x its time with the tiles (benchmarks/README.md).

`use_vocab_chunks` gives a causal LM's output layer this ability (its class becomes a subclass
that returns its input while `hidden_states_out` is active in the calling thread); the callers
in `rlhf.core.logprobs` ask for it through `rlhf.core.logprobs.DeferredHead`. The layer is taken
only where it is plain: a 2-D weight, not a DeepSpeed ZeRO-3 partition, and a model whose logits
are exactly the layer's output (checked once on a short input when the layer is given the
ability: a model that scales or caps its logits keeps the plain path). The first log-probs a
model computes this way are compared with the plain path's on the same positions
(`rlhf.fastpaths.verdicts`, path ``vocab_chunks``). Switch: ``--no-vocab-chunks``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from rlhf.core.logprobs import DeferredHead
from rlhf.core.modeling import innermost
from rlhf.fastpaths.in_place_gradients import (grad_of, in_place, largest, largest_difference, settle_first,
                                               step_scratch)
from rlhf.fastpaths.verdicts import settle, verdict

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 23  # float32 logits of a chunk of distillation positions (32 MB): positions x vocabulary
TILE_ELEMENTS = 1 << 17  # float32 logits per log-prob tile on a CPU (512 KB, a core's L2 cache): positions x block
TILE_POSITIONS = 512  # positions per tile at most on a CPU (more: the weight's gradient is summed over tiles)
ACCELERATOR_TILE_ELEMENTS = 1 << 23  # the same on a GPU (32 MB: few, large products; the earlier size, kept)
ACCELERATOR_TILE_POSITIONS = 4096
MIN_BLOCK = 256  # vocabulary entries per block at least
FULL_LOGITS_UP_TO = 64 << 20  # bytes of float32 logits up to which a call with a backward takes them whole
KNOWN_GRADIENT_ELEMENTS = 40 << 20  # float32 logits a known-gradient call holds at once (168 MB): positions x vocabulary
KNOWN_GRADIENT_CHECK_VOCABULARY = 4096  # vocabulary entries of the first known-gradient call's comparison
CHECK_POSITIONS = 64  # positions of the first call compared with the plain path
_DEFERRING = threading.local()  # .head: the output layer returning its input in this thread
_MISSED = "_rlhf_known_gradient_missed"  # in an output layer's __dict__: a loss's gradient was not the announced one


def chunk_positions(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """x·Wᵀ (+ b): x (M, H), W (V, H) -> (M, V), through oneDNN where the layer's own forward uses it."""
    if onednn:
        from rlhf.fastpaths.cpu_linear import onednn_product

        return onednn_product(x, weight, bias)
    return F.linear(x, weight, bias)


def _tiles(count: int, vocab: int, device: torch.device) -> Iterator[tuple[int, int, list[tuple[int, int]]]]:
    """(first, end, vocabulary blocks) of each chunk of at most `TILE_POSITIONS` positions; a block
    holds ``TILE_ELEMENTS / positions`` tokens of the vocabulary (at least `MIN_BLOCK`); off a CPU
    the ``ACCELERATOR_`` sizes."""
    cpu = device.type == "cpu"
    positions = TILE_POSITIONS if cpu else ACCELERATOR_TILE_POSITIONS
    elements = TILE_ELEMENTS if cpu else ACCELERATOR_TILE_ELEMENTS
    for first in range(0, count, positions):
        end = min(first + positions, count)
        width = min(vocab, max(MIN_BLOCK, elements // (end - first)))
        yield first, end, [(v, min(v + width, vocab)) for v in range(0, vocab, width)]


class _ChunkedLogprobs(torch.autograd.Function):
    """(ℓ (K,), H (K,)) of hidden states (K, H) under the output layer (W, b): the module docstring's
    formulas, tile by tile, z recomputed in the backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temperature: float, with_entropy: bool,
                onednn: bool, owner: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        count = hidden.shape[0]
        floats = {"dtype": torch.float32, "device": hidden.device}
        lse = torch.empty(count, **floats)  # (K,) logsumexp(z)
        target_logit = torch.zeros(count, **floats)  # (K,) z[y]
        entropy = torch.empty(count if with_entropy else 0, **floats)  # (K,) or (0,)
        for first, end, blocks in _tiles(count, weight.shape[0], hidden.device):
            rows, h, y = slice(first, end), hidden[first:end], targets[first:end]  # (c, H), (c,)
            tops = torch.empty(len(blocks), end - first, **floats)  # (n, c) max of each block, m
            sums = torch.empty(len(blocks), end - first, **floats)  # (n, c) Σ_v exp(z − m)
            weighted = torch.empty(len(blocks) if with_entropy else 0, end - first, **floats)  # Σ e^(z−m)·(z − m)
            for i, (v0, v1) in enumerate(blocks):
                z = _logits(h, weight[v0:v1], bias[v0:v1] if bias is not None else None, temperature,
                            onednn)  # (c, b)
                inside = (y >= v0) & (y < v1)  # (c,)
                target_logit[rows] += torch.where(
                    inside, z.gather(-1, (y - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(-1), 0.0)
                tops[i] = z.amax(dim=-1)
                shift = torch.where(torch.isinf(tops[i]), 0.0, tops[i])  # (c,) a row all −inf: 0
                shifted = z.sub_(shift[:, None])  # (c, b) z − m, in place of z
                if with_entropy:
                    e = torch.exp(shifted)  # (c, b)
                    sums[i] = e.sum(dim=-1)
                    weighted[i] = e.mul_(shifted).sum(dim=-1)
                else:
                    sums[i] = shifted.exp_().sum(dim=-1)  # in place: exp(z − m)
            top = tops.amax(dim=0)  # (c,) M = max over the blocks
            top = torch.where(torch.isinf(top), 0.0, top)
            scale = (tops - top).exp_()  # (n, c) exp(m − M): 0 for a block all −inf
            total = (sums * scale).sum(dim=0)  # (c,) Σ_v exp(z − M)
            lse[rows] = top + total.log()
            if with_entropy:  # H = lse − Σ_v p z; Σ_v e^(z−M)·z = Σ_blocks e^(m−M)·(Σ e^(z−m)·(z − m) + m·Σ e^(z−m))
                shifts = torch.where(torch.isinf(tops), 0.0, tops)  # (n, c)
                entropy[rows] = lse[rows] - ((weighted + shifts * sums) * scale).sum(dim=0) / total
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.with_entropy, ctx.onednn, ctx.owner = temperature, with_entropy, onednn, owner
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return target_logit - lse, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        grad_hidden, grad_weight, grad_bias = _tiles_backward(
            hidden, weight, bias, targets, lse, entropy if ctx.with_entropy else None, grad_logprobs, grad_entropy,
            temperature=ctx.temperature, onednn=ctx.onednn, owner=ctx.owner, wants=ctx.needs_input_grad[:3])
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _tiles_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    lse: torch.Tensor, entropy: torch.Tensor | None, grad_logprobs: torch.Tensor | None,
                    grad_entropy: torch.Tensor | None, *, temperature: float, onednn: bool,
                    owner: nn.Module | None, wants: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
    """(∂h, ∂W, ∂b) of `_ChunkedLogprobs` for the gradients ``grad_logprobs`` (K,) and ``grad_entropy``
    (K,) (``entropy`` None: the forward computed none), z recomputed tile by tile; ``wants``: which of
    h, W, b want theirs. ∂W goes into the weight's ``.grad`` instead (and None is returned) where a
    backend's backward lets it (`rlhf.fastpaths.in_place_gradients`)."""
    tau = temperature
    count = hidden.shape[0]
    g_lp = (grad_logprobs if grad_logprobs is not None else lse.new_zeros(count)).float() / tau  # (K,)
    g_ent = grad_entropy.float() / tau if entropy is not None and grad_entropy is not None else None  # (K,)
    want_hidden, want_weight = wants[0], wants[1]
    want_bias = bias is not None and wants[2]
    floats = {"dtype": torch.float32, "device": hidden.device}
    # ∂z = g_ℓ·onehot(y) − q, q = g_ℓ·p (+ g_H·p·(log p + H)); the onehot term is added once at the end
    grad_hidden = torch.empty(hidden.shape, **floats) if want_hidden else None  # (K, H)
    # (V, H), (V,): written by the first chunk of positions, summed into by the others; or ∂W added
    # into the weight's .grad block by block (rlhf.fastpaths.in_place_gradients), after a first
    # backward that compares the two
    grad_weight, sums = None, []  # sums: [(a (V, H) ∂W goes into, whether it starts empty)]
    place = want_weight and owner is not None and in_place(weight, owner, "head")
    checking = place and verdict(owner, "in_place_gradients/head") is None
    fresh = checking and weight.grad is None  # the first sum in place goes into a new .grad, then compared
    if want_weight and (not place or checking):
        grad_weight = (torch.empty if count else torch.zeros)(weight.shape, **floats)
        sums.append((grad_weight, True))
    if place:
        sums.append((torch.zeros(weight.shape, **floats) if checking and not fresh else grad_of(weight), False))
    grad_bias = (torch.empty if count else torch.zeros)(weight.shape[0], **floats) if want_bias else None
    for first, end, blocks in _tiles(count, weight.shape[0], hidden.device):
        rows, h = slice(first, end), hidden[first:end]  # (c, H)
        # without entropy q = g_ℓ·p: p's rows are scaled by g_ℓ after the products, not in the tile
        row_scale = g_lp[rows] if g_ent is None else torch.ones(end - first, **floats)  # (c,)
        scaled_h = (h.float() * -row_scale[:, None]) if want_weight or want_bias else None  # (c, H)
        products = torch.zeros(end - first, hidden.shape[1], **floats)  # (c, H) Σ_blocks q/row_scale·W_b
        for v0, v1 in blocks:
            z = _logits(h, weight[v0:v1], bias[v0:v1] if bias is not None else None, tau, onednn)  # (c, b)
            log_p = z.sub_(lse[rows, None])  # (c, b), in place of z
            if g_ent is None:
                q = log_p.exp_()  # (c, b) p, in place
            else:  # q = p·(g_ℓ + g_H·(log p + H))
                p = torch.exp(log_p)  # (c, b)
                q = log_p.add_(entropy[rows, None]).mul_(g_ent[rows, None]).add_(g_lp[rows, None]).mul_(p)
            if want_hidden:
                if q.dtype == weight.dtype and not onednn:
                    products.addmm_(q, weight[v0:v1])  # (c, H) += q·W_b
                else:
                    products += _linear(q.to(weight.dtype), weight[v0:v1].t(), None, onednn)
            for into, starts_empty in sums:  # ∂W_b = −qᵀ·h (rows scaled), (b, H)
                if first == 0 and starts_empty:
                    torch.mm(q.t(), scaled_h, out=into[v0:v1])
                else:
                    into[v0:v1].addmm_(q.t(), scaled_h)
            if want_bias:  # ∂b_b = −qᵀ·row_scale, (b,)
                if first == 0:
                    torch.mv(q.t(), -row_scale, out=grad_bias[v0:v1])
                else:
                    grad_bias[v0:v1].addmv_(q.t(), -row_scale)
        if want_hidden:  # ∂h = g_ℓ·W_y − row_scale·Σ q·W
            grad_hidden[rows] = weight[targets[rows]].float().mul_(g_lp[rows, None]) \
                .sub_(products.mul_(row_scale[:, None]))
    if want_weight:
        onehot = hidden.float() * g_lp[:, None]  # (K, H) the onehot term: g_ℓ·h at y
        for into, _ in sums:
            into.index_add_(0, targets, onehot)
        if checking:  # the first backward in place: its sum against the plain one
            agrees = settle_first(owner, "head", largest_difference(sums[1][0], grad_weight),
                                  largest(grad_weight))
            if fresh and agrees:  # .grad holds it: autograd is handed nothing
                grad_weight = None
            elif fresh:  # .grad goes back to none; autograd is handed the plain sum
                weight.grad = None
    if want_bias:
        grad_bias.index_add_(0, targets, g_lp)
    return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None)


def known_gradient_rows(vocab: int) -> int:
    """Positions whose (c, V) float32 logits `_KnownGradientLogprobs` holds at once (at least 1)."""
    return max(1, KNOWN_GRADIENT_ELEMENTS // max(vocab, 1))


def _known_gradient_pass(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor,
                         temperature: float, onednn: bool, grad_weight: torch.Tensor,
                         fresh: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ℓ (K,), logsumexp(z) (K,), ∂h (K, H)) of hidden states (K, H) under W (V, H) for the loss
    gradient ∂L/∂ℓ = ``grad`` (K,), ∂W added into ``grad_weight`` (V, H) (``fresh``: written by the
    first chunk, whatever it held): the module docstring's known-gradient formulas,
    `known_gradient_rows` positions x the whole vocabulary at a time. Each chunk reads and writes
    all of ``grad_weight`` (311 MB at Qwen2's vocabulary), so chunks are as large as the budget
    allows."""
    count = hidden.shape[0]
    floats = {"dtype": torch.float32, "device": hidden.device}
    logprobs, lse = torch.empty(count, **floats), torch.empty(count, **floats)  # (K,), (K,)
    grad_hidden = torch.empty(hidden.shape, **floats)  # (K, H)
    g = grad.float() / temperature  # (K,) ∂L/∂z = g·(onehot(y) − p)
    chunks = -(-count // known_gradient_rows(weight.shape[0]))
    size = max(1, -(-count // max(chunks, 1)))  # chunks of equal size
    # one (c, V) buffer for every chunk, and for every micro-batch of the optimizer step
    # (`step_scratch`): a fresh one each would be mapped and zeroed by the kernel each time (glibc
    # maps blocks this large; at Qwen2's vocabulary 155 MB a chunk)
    buffer = step_scratch(min(size, count), weight.shape[0], torch.float32, hidden.device) \
        if weight.dtype == torch.float32 and not onednn else None  # (c, V)
    for first in range(0, count, size):
        rows = slice(first, min(first + size, count))
        h, y, g_c = hidden[rows], targets[rows], g[rows]  # (c, H), (c,), (c,)
        if buffer is not None:  # z = h·Wᵀ / τ, the product F.linear makes
            z = torch.mm(h, weight.t(), out=buffer[:rows.stop - first])  # (c, V)
            z = z.div_(temperature) if temperature != 1.0 else z
        else:
            z = _logits(h, weight, None, temperature, onednn)  # (c, V)
        top = z.amax(dim=-1)  # (c,)
        top = torch.where(torch.isinf(top), 0.0, top)  # a row all −inf: 0
        target_logit = z.gather(-1, y[:, None]).squeeze(-1)  # (c,)
        total = z.sub_(top[:, None]).exp_().sum(dim=-1)  # (c,) Σ_v exp(z − m), z now exp(z − m)
        lse[rows] = top + total.log()
        logprobs[rows] = target_logit - lse[rows]
        p = z.div_(total[:, None])  # (c, V) softmax(z), in place
        if p.dtype == weight.dtype and not onednn:
            products = torch.mm(p, weight)  # (c, H) p·W
        else:
            products = _linear(p.to(weight.dtype), weight.t(), None, onednn).float()
        grad_hidden[rows] = weight[y].float().mul_(g_c[:, None]).sub_(products.mul_(g_c[:, None]))
        if fresh and first == 0:
            torch.mm(p.t(), h.float() * -g_c[:, None], out=grad_weight)  # (V, H) = −pᵀ·(g·h)
        else:
            grad_weight.addmm_(p.t(), h.float() * -g_c[:, None])  # (V, H) += −pᵀ·(g·h)
    grad_weight.index_add_(0, targets, hidden.float() * g[:, None])  # the onehot rows: g·h at y
    return logprobs, lse, grad_hidden


class _KnownGradientLogprobs(torch.autograd.Function):
    """ℓ (K,) of hidden states (K, H) under the output layer's W for a loss whose gradient ∂L/∂ℓ
    (``grad``, (K,)) is known before the forward: the backward is done in the forward (∂W into the
    weight's ``.grad``, ∂h kept), and the backward only checks that the gradient it is handed is
    that one; any other is the sum of the two, and the difference goes through the tiles' backward
    (∂h and ∂W are linear in it)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor,
                temperature: float, onednn: bool, owner: nn.Module) -> torch.Tensor:
        fresh = weight.grad is None  # the step's first: .grad is written, not zeroed and added to
        into = torch.empty_like(weight, memory_format=torch.contiguous_format) if fresh else grad_of(weight)  # (V, H)
        logprobs, lse, grad_hidden = _known_gradient_pass(hidden, weight, targets, grad, temperature, onednn, into,
                                                          fresh)
        if fresh:
            weight.grad = into
        ctx.save_for_backward(hidden, weight, targets, grad, lse, grad_hidden)
        ctx.temperature, ctx.onednn, ctx.owner = temperature, onednn, owner
        return logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, grad, lse, grad_hidden = ctx.saved_tensors
        grad_weight = None
        if not torch.equal(grad_logprobs, grad):  # the loss's gradient was not the one announced
            if ctx.owner is not None and not ctx.owner.__dict__.get(_MISSED):
                ctx.owner.__dict__[_MISSED] = True
                log.warning("vocab chunks: the loss's gradient with respect to the log-probs was not the one it "
                            "announced (its gradient at two stand-in log-probs); the update stays exact, but the "
                            "output layer's backward runs twice where that happens (--no-vocab-chunks runs it once)")
            extra_hidden, grad_weight, _ = _tiles_backward(
                hidden, weight, None, targets, lse, None, grad_logprobs - grad, None, temperature=ctx.temperature,
                onednn=ctx.onednn, owner=ctx.owner, wants=(True, True, False))
            grad_hidden = grad_hidden + extra_hidden.float()
        return (grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """c (K,) = −Σ_v softmax(z')·log_softmax(z) of student hidden states (K, H) under (W, b) and
    teacher hidden states (K, H') under (W', b') (no gradient): the module docstring's formulas."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None,
                onednn: tuple[bool, bool]) -> torch.Tensor:
        size = chunk_positions(weight.shape[0])
        count = hidden.shape[0]
        cross = torch.empty(count, dtype=torch.float32, device=hidden.device)  # (K,)
        lse = torch.empty(count, dtype=torch.float32, device=hidden.device)  # (K,) logsumexp(z)
        for begin in range(0, count, size):
            end = min(begin + size, count)
            z = _logits(hidden[begin:end], weight, bias, 1.0, onednn[0])  # (c, V)
            q = torch.softmax(_logits(teacher_hidden[begin:end], teacher_weight, teacher_bias, 1.0, onednn[1]),
                              dim=-1).masked_fill_(torch.isinf(z), 0)  # (c, V) q·f
            lse[begin:end] = torch.logsumexp(z, dim=-1)
            log_p = z.sub_(lse[begin:end, None])  # (c, V)
            cross[begin:end] = -(q * log_p.masked_fill_(q == 0, 0)).sum(dim=-1)  # q·f = 0: no term (0·-inf)
        ctx.save_for_backward(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, lse)
        ctx.onednn = onednn
        return cross

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_cross: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, lse = ctx.saved_tensors
        count, size = hidden.shape[0], chunk_positions(weight.shape[0])
        g = grad_cross.float()  # (K,)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # (K, H)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None  # (V, H)
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if bias is not None and ctx.needs_input_grad[2] else None  # (V,)
        for begin in range(0, count, size):
            end = min(begin + size, count)
            z = _logits(hidden[begin:end], weight, bias, 1.0, ctx.onednn[0])  # (c, V)
            q = torch.softmax(_logits(teacher_hidden[begin:end], teacher_weight, teacher_bias, 1.0, ctx.onednn[1]),
                              dim=-1).masked_fill_(torch.isinf(z), 0)  # (c, V) q·f
            p = z.sub_(lse[begin:end, None]).exp_()  # (c, V)
            grad_z = p.mul_(q.sum(dim=-1, keepdim=True)).sub_(q).mul_(g[begin:end, None])  # (c, V)
            if grad_hidden is not None:
                grad_hidden[begin:end] = _linear(grad_z.to(weight.dtype), weight.t(), None, ctx.onednn[0])  # (c, H)
            if grad_weight is not None:
                grad_weight.addmm_(grad_z.t(), hidden[begin:end].float())  # (V, H)
            if grad_bias is not None:
                grad_bias += grad_z.sum(dim=0)
        return (grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None, None)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
            onednn: bool) -> torch.Tensor:
    """z = (h·Wᵀ + b) / τ in float32, (c, V), as the plain path computes it (the product in the
    layer's dtype, then float32)."""
    z = _linear(hidden, weight, bias, onednn).float()  # (c, V)
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedHead(DeferredHead):
    """Mixed in after an output layer's own class (`use_vocab_chunks`; a base placed first would
    change the layer's memory layout); `_chunked_class` gives the pair this forward, and
    ``_layer_forward``, the layer class's own forward."""

    __slots__ = ()

    def _deferring_forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(_DEFERRING, "head", None) is self:
            return x  # (..., H): the hidden states, turned into log-probs by `position_logprobs`
        return self._layer_forward(x)

    def defers(self) -> bool:
        return (self.weight.dim() == 2 and not hasattr(self.weight, "ds_id")
                and verdict(self, "vocab_chunks") is not False)

    @contextlib.contextmanager
    def hidden_states_out(self) -> Iterator[None]:
        previous = getattr(_DEFERRING, "head", None)
        _DEFERRING.head = self
        try:
            yield
        finally:
            _DEFERRING.head = previous

    def position_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                          with_entropy: bool = False,
                          gradient: Callable[[], torch.Tensor | None] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        onednn = self._onednn(hidden)
        if self._full_logits_pay(hidden):
            verdict_now = False
        else:
            if verdict(self, "vocab_chunks") is None and hidden.shape[0]:
                self._check(hidden[:CHECK_POSITIONS], targets[:CHECK_POSITIONS], temperature, onednn)
            verdict_now = verdict(self, "vocab_chunks")
        if verdict_now and gradient is not None and self._takes_known_gradient(hidden, with_entropy):
            grad = gradient()  # (K,) ∂L/∂ℓ, or None
            if grad is not None and self._known_gradient_checked(hidden, targets, grad, temperature, onednn):
                return _KnownGradientLogprobs.apply(hidden, self.weight, targets, grad, temperature, onednn,
                                                    self), None  # (K,)
        if verdict_now is False:  # this call's hidden states through the plain path
            logits = self._layer_forward(hidden).float()  # (K, V)
            log_p = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)  # (K, V)
            entropy = -(log_p.exp() * log_p).sum(dim=-1) if with_entropy else None  # (K,)
            return log_p.gather(-1, targets[:, None]).squeeze(-1), entropy
        logprobs, entropy = _ChunkedLogprobs.apply(hidden, self.weight, self.bias, targets, temperature,
                                                   with_entropy, onednn, self)  # (K,), (K,)
        return logprobs, (entropy if with_entropy else None)

    def cross_entropy_to(self, hidden: torch.Tensor, teacher: DeferredHead,
                         teacher_hidden: torch.Tensor) -> torch.Tensor:
        onednn = (self._onednn(hidden), teacher._onednn(teacher_hidden))
        if self._full_logits_pay(hidden):
            return _full_cross_entropy(self._layer_forward(hidden), teacher._layer_forward(teacher_hidden))
        if verdict(self, "vocab_chunks/distill") is None and hidden.shape[0]:
            with torch.no_grad():
                k = CHECK_POSITIONS
                logits = self._layer_forward(hidden[:k]).float()  # (k, V)
                teacher_logits = teacher._layer_forward(teacher_hidden[:k]).float()  # (k, V)
                plain = _full_cross_entropy(logits, teacher_logits).mean()
                chunked = _ChunkedCrossEntropy.apply(hidden[:k], self.weight, self.bias, teacher_hidden[:k],
                                                     teacher.weight, teacher.bias, onednn).mean()
            tolerance = 1e-3 if self.weight.dtype == torch.float32 else 5e-2
            settle(self, "vocab_chunks/distill", float((chunked - plain).abs()), tolerance, who="vocab chunks",
                   switch="--no-vocab-chunks")
        if verdict(self, "vocab_chunks/distill") is False:  # these positions through the full logits
            return _full_cross_entropy(self._layer_forward(hidden), teacher._layer_forward(teacher_hidden))
        return _ChunkedCrossEntropy.apply(hidden, self.weight, self.bias, teacher_hidden, teacher.weight,
                                          teacher.bias, onednn)  # (K,)

    def _takes_known_gradient(self, hidden: torch.Tensor, with_entropy: bool) -> bool:
        """Whether a call may run `_KnownGradientLogprobs`: a backward follows (grad enabled), no
        entropy or bias, and ∂W may go into ``.grad`` now (a backend's optimizer step). Nothing
        here depends on what ran before (the first call of a run takes it as the later ones do), so
        a resumed run takes the same path at every step as one that was never stopped."""
        return (torch.is_grad_enabled() and hidden.requires_grad and self.weight.requires_grad and self.bias is None
                and not with_entropy and hidden.shape[0] > 0 and in_place(self.weight, self, "head")
                and verdict(self, "vocab_chunks/known_gradient") is not False)

    def _known_gradient_checked(self, hidden: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor,
                                temperature: float, onednn: bool) -> bool:
        """The first known-gradient call compares ℓ, ∂h and ∂W with the tiles' forward and backward on
        its first `CHECK_POSITIONS` positions and the first `KNOWN_GRADIENT_CHECK_VOCABULARY`
        vocabulary entries (targets taken modulo that); largest differences relative to each one's
        largest entry."""
        if verdict(self, "vocab_chunks/known_gradient") is None:
            vocab = min(self.weight.shape[0], KNOWN_GRADIENT_CHECK_VOCABULARY)
            h, w = hidden[:CHECK_POSITIONS].detach(), self.weight[:vocab].detach()  # (k, H), (v, H)
            y, g = targets[:CHECK_POSITIONS] % vocab, grad[:CHECK_POSITIONS]  # (k,), (k,)
            with torch.no_grad():
                known_weight = torch.zeros(w.shape, dtype=torch.float32, device=w.device)  # (v, H)
                known, _, known_hidden = _known_gradient_pass(h, w, y, g, temperature, onednn, known_weight)
            with torch.enable_grad():
                tiles_h, tiles_w = h.clone().requires_grad_(), w.clone().requires_grad_()
                tiles, _ = _ChunkedLogprobs.apply(tiles_h, tiles_w, None, y, temperature, False, onednn)  # (k,)
                torch.autograd.backward(tiles, g)
            difference = max(float((a - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)
                             for a, b in ((known, tiles.detach()), (known_hidden, tiles_h.grad),
                                          (known_weight, tiles_w.grad)))
            tolerance = 1e-5 if self.weight.dtype == torch.float32 else 5e-2
            settle(self, "vocab_chunks/known_gradient", difference, tolerance, who="vocab chunks (known gradient)",
                   switch="--no-vocab-chunks")
        return verdict(self, "vocab_chunks/known_gradient") is True

    def _full_logits_pay(self, hidden: torch.Tensor) -> bool:
        """Whether this call takes the full logits: they are small (`FULL_LOGITS_UP_TO`), where tiles
        would only add the backward's recomputation. By size alone, with or without a backward, so
        the policy and the reference score the same micro-batch the same way, to the bit."""
        return hidden.shape[0] * self.weight.shape[0] * 4 <= FULL_LOGITS_UP_TO

    def _onednn(self, hidden: torch.Tensor) -> bool:
        from rlhf.fastpaths.cpu_linear import OneDnnLinear, takes_onednn

        return isinstance(self, OneDnnLinear) and takes_onednn(hidden, self.weight, self.bias)

    def _check(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, onednn: bool) -> None:
        with torch.no_grad():
            logits = self._layer_forward(hidden).float()  # (k, V)
            plain = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # (k,)
            chunked, _ = _ChunkedLogprobs.apply(hidden, self.weight, self.bias, targets, temperature, False, onednn)
            difference = float((chunked - plain).abs().max())
        tolerance = 1e-3 if self.weight.dtype == torch.float32 else 5e-2
        settle(self, "vocab_chunks", difference, tolerance, who="vocab chunks", switch="--no-vocab-chunks")


def _full_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The plain path of `_ChunkedCrossEntropy`: logits (K, V) of both, held whole; (K,)."""
    teacher_probs = torch.softmax(teacher_logits.float(), dim=-1)  # (K, V)
    log_p = torch.log_softmax(logits.float(), dim=-1)  # (K, V)
    return -torch.masked_fill(teacher_probs * log_p, torch.isinf(logits), 0).sum(dim=-1)  # (K,)


@functools.cache
def _chunked_class(cls: type) -> type:
    return type(f"Chunked{cls.__name__}", (cls, _ChunkedHead), {
        "__module__": __name__, "forward": _ChunkedHead._deferring_forward, "_layer_forward": cls.forward})


def use_vocab_chunks(model: nn.Module) -> bool:
    """Give ``model``'s output layer (``get_output_embeddings()``) the chunked log-probs of this module,
    where it is a plain linear layer whose output is the model's logits; returns whether it did."""
    base = innermost(model)
    get = getattr(base, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, _ChunkedHead):
        return True
    if not isinstance(head, nn.Linear) or head.weight.dim() != 2 or hasattr(head.weight, "ds_id"):
        return False
    if not _logits_are_head_output(base, head):
        log.info("vocab chunks: %s post-processes its logits; its log-probs use the plain path",
                 type(base).__name__)
        return False
    head.__class__ = _chunked_class(type(head))
    return True


def _logits_are_head_output(model: nn.Module, head: nn.Linear) -> bool:
    """Whether ``model``'s logits on a short input equal its output layer applied to what that layer
    receives (no scaling, capping or bias added after it)."""
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _module, inputs, output: seen.append(output.detach()))
    try:
        ids = torch.arange(1, 5, device=head.weight.device)[None] % head.weight.shape[0]  # (1, 4)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits  # (1, 4, V)
        finally:
            model.train(was_training)
    except Exception:  # noqa: BLE001 - a model this check cannot run keeps the plain path
        return False
    finally:
        hook.remove()
    return len(seen) == 1 and seen[0].shape == logits.shape and torch.equal(seen[0].to(logits.dtype), logits)
