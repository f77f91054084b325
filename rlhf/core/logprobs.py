"""Per-token log-probs (and entropy) of the tokens in a batch under a causal LM.

``logprobs[:, t] = log softmax(z_t / τ)[token_{t+1}]`` with float32 logits z and the sampling
temperature τ, so training sees the distribution the engine sampled from. Only positions from
the first action token on are projected to the vocabulary (prompts need no logits), a row's
last token is not run at all (it predicts nothing; `without_last_token`), and the vocabulary
softmax runs in row chunks to bound float32 memory. A model whose output layer is a
`DeferredHead` (``rlhf.fastpaths.vocab_chunks``, on unless ``--no-vocab-chunks``) hands back its
final hidden states instead, and the layer turns them into log-probs a tile at a time,
so no float32 logits of a whole micro-batch are ever held.

Shape legend: ``B`` sequences, ``T`` tokens, ``A = T - 1`` action positions, ``V`` vocabulary.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from typing import Callable, ContextManager, Iterator

import torch

from rlhf.core.masked import last_real_index
from rlhf.core.modeling import accepts_logits_to_keep, base_model, innermost

_ROWS_PER_CHUNK = 8
_KNOWN = threading.local()  # .predict: `known_logprob_gradient`'s, in this thread


def first_action_position(action_mask: torch.Tensor) -> int:
    """The first column (over the batch) where any row has an action; 0 for an empty mask."""
    any_action = action_mask.bool().any(dim=0)  # (A,)
    return int(any_action.nonzero()[0]) if any_action.any() else 0


def without_last_token(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) ``attention_mask`` with each row's last real token unset (any padding side): that token
    is only a target, nothing after it is predicted, so a forward that scores next tokens need not
    run it (one token per row less: 1/T of the work)."""
    mask = attention_mask.clone()  # (B, T)
    last = last_real_index(mask)  # (B,)
    rows = mask.bool().any(dim=1).nonzero().squeeze(1)  # (b,) rows with a real token
    mask[rows, last[rows]] = 0
    return mask


class OwnLogprobs(abc.ABC):
    """A model wrapper that computes `token_logprobs` its own way (a fast path, e.g.
    `rlhf.fastpaths.packing.PackedModel`) when ``runs_own_logprobs``; the same contract, and the
    same numbers up to float rounding."""

    runs_own_logprobs: bool = False

    @abc.abstractmethod
    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor, *,
                       temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`token_logprobs` of ``(input_ids, attention_mask, action_mask)`` under the wrapped model."""


class DeferredHead(abc.ABC):
    """An output layer that can hand back its input, the final hidden states, instead of logits, and
    turn hidden states into log-probs itself (`rlhf.fastpaths.vocab_chunks`: without holding the
    (K, V) logits). Mixed into the layer's class; `deferred_head` finds it."""

    __slots__ = ()  # a mixin: the layer keeps its memory layout, so its class can be swapped

    @abc.abstractmethod
    def defers(self) -> bool:
        """Whether it can do so now (its weight is whole, its check has not failed)."""

    @abc.abstractmethod
    def hidden_states_out(self) -> ContextManager[None]:
        """Within it, forwards in this thread return the (..., H) hidden states as ``.logits``."""

    @abc.abstractmethod
    def position_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                          with_entropy: bool = False,
                          gradient: Callable[[], torch.Tensor | None] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log softmax(logits / τ)[target] (K,) (and entropy (K,)) of hidden states (K, H), targets (K,).
        ``gradient`` (only inside `known_logprob_gradient`): ``gradient()`` is ∂L/∂ℓ (K,) of the loss
        these log-probs go into, or None; a head may ignore it."""

    @abc.abstractmethod
    def cross_entropy_to(self, hidden: torch.Tensor, teacher: DeferredHead,
                         teacher_hidden: torch.Tensor) -> torch.Tensor:
        """−Σ_v softmax(teacher's logits)_v · log_softmax(own logits)_v (K,) of hidden states (K, H)
        and the teacher's (K, H'), ``teacher`` another deferred head over the same vocabulary;
        vocabulary entries where the own logit is ±inf add nothing. Gradients reach the own side only."""


def deferred_head(model: torch.nn.Module) -> DeferredHead | None:
    """``model``'s output layer if it is a `DeferredHead` that defers now, else None."""
    get = getattr(innermost(model), "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, DeferredHead) and head.defers() else None


def hidden_states_out(head: DeferredHead | None) -> ContextManager[None]:
    """``head.hidden_states_out()``, or nothing without a deferred head."""
    return head.hidden_states_out() if head is not None else contextlib.nullcontext()


@contextlib.contextmanager
def known_logprob_gradient(predict: Callable[[], torch.Tensor | None]) -> Iterator[None]:
    """Within it, the log-probs with a gradient that `token_logprobs` / `scatter_logprobs` compute in
    this thread (one batch's) are those whose loss L has ∂L/∂ℓ = ``predict()`` (B, A) in their (B, A)
    layout, or None where it cannot tell: a deferred head may then do the backward of its
    vocabulary projection in the forward (``rlhf.fastpaths.vocab_chunks``, one product with the
    weight less). ``predict`` runs at most once, on the first call that asks; the head checks in its
    backward that the gradient it gets is that one (another is still exact, only slower)."""
    cached: list[torch.Tensor | None] = []

    def once() -> torch.Tensor | None:
        if not cached:
            cached.append(predict())
        return cached[0]

    previous = getattr(_KNOWN, "predict", None)
    _KNOWN.predict = once
    try:
        yield
    finally:
        _KNOWN.predict = previous


def _known_at(pick: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Callable[[], torch.Tensor | None]]:
    """The ``gradient`` argument of a deferred head's `position_logprobs` for the positions ``pick``
    takes from a (B, A) tensor, inside `known_logprob_gradient` ({} outside it)."""
    predict = getattr(_KNOWN, "predict", None)
    if predict is None or not torch.is_grad_enabled():
        return {}

    def gradient() -> torch.Tensor | None:
        grad = predict()  # (B, A) or None
        return pick(grad).contiguous() if grad is not None else None  # (K,)

    return {"gradient": gradient}


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   action_mask: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, A) of each next token, zero before the first action column; entropy (B, A) if asked.

    Gradients flow when called with grad enabled. A model wrapper that computes log-probs its own
    way (`OwnLogprobs`: `rlhf.fastpaths.packing.PackedModel` runs the batch packed) does so here.
    """
    if isinstance(model, OwnLogprobs) and model.runs_own_logprobs:
        return model.token_logprobs(input_ids, attention_mask, action_mask, temperature=temperature,
                                    with_entropy=with_entropy)
    batch_size, length = input_ids.shape  # (B, T)
    start = first_action_position(action_mask)  # logits at positions start..T-2 predict tokens start+1..T-1
    keep = length - 1 - start
    logprobs = input_ids.new_zeros((batch_size, length - 1), dtype=torch.float32)  # (B, A)
    entropy = torch.zeros_like(logprobs) if with_entropy else None
    if keep <= 0:
        return logprobs, entropy
    kwargs = {"logits_to_keep": keep} if accepts_logits_to_keep(type(base_model(model))) else {}
    head = deferred_head(model)
    # The last column is padding or a row's last token, which predicts nothing: it is not run.
    with hidden_states_out(head):
        logits = model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1], use_cache=False,
                       **kwargs).logits[:, -keep:, :]  # (B, A - start, V), or (B, A - start, H) hidden states
    targets = input_ids[:, start + 1:]  # (B, A - start)
    if head is not None:
        flat_lp, flat_ent = head.position_logprobs(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                   temperature=temperature, with_entropy=with_entropy,
                                                   **_known_at(lambda g: g[:, start:].reshape(-1)))  # (B·A',)
        logprobs = torch.cat([logprobs[:, :start], flat_lp.view(batch_size, keep)], dim=1)  # (B, A)
        if with_entropy:
            entropy = torch.cat([entropy[:, :start], flat_ent.view(batch_size, keep)], dim=1)  # (B, A)
        return logprobs, entropy
    chunks_lp, chunks_ent = [], []
    for rows in range(0, batch_size, _ROWS_PER_CHUNK):
        z = logits[rows:rows + _ROWS_PER_CHUNK].float()  # (b, A', V)
        if temperature != 1.0:  # dividing by 1 changes nothing but costs a pass over (b, A', V)
            z = z / temperature
        # log_softmax, not z - logsumexp(z): its backward is one fused pass
        log_p = torch.log_softmax(z, dim=-1)  # (b, A', V)
        chunks_lp.append(log_p.gather(-1, targets[rows:rows + _ROWS_PER_CHUNK, :, None]).squeeze(-1))  # (b, A')
        if with_entropy:
            chunks_ent.append(-(log_p.exp() * log_p).sum(dim=-1))  # H = -Σ p log p
    logprobs = torch.cat([logprobs[:, :start], torch.cat(chunks_lp)], dim=1)  # (B, A)
    if with_entropy:
        entropy = torch.cat([entropy[:, :start], torch.cat(chunks_ent)], dim=1)  # (B, A)
    return logprobs, entropy


_POSITIONS_PER_CHUNK = 2048


def scatter_logprobs(logits: torch.Tensor, targets: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor],
                      logprobs: torch.Tensor, entropy: torch.Tensor | None, temperature: float,
                      head: DeferredHead | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / τ)[target] (and entropy) of K positions, logits (K, V), targets (K,),
    written at ``where`` (rows (K,), columns (K,)) into the zero (B, A) ``logprobs`` / ``entropy``.
    With a deferred ``head``, ``logits`` are its (K, H) hidden states."""
    if head is not None:
        flat_lp, flat_ent = head.position_logprobs(logits, targets, temperature=temperature,
                                                   with_entropy=entropy is not None,
                                                   **_known_at(lambda g: g[where]))  # (K,)
        logprobs = logprobs.index_put(where, flat_lp)  # (B, A)
        if entropy is not None:
            entropy = entropy.index_put(where, flat_ent)  # (B, A)
        return logprobs, entropy
    chunks_lp, chunks_ent = [], []
    for begin in range(0, targets.numel(), _POSITIONS_PER_CHUNK):
        z = logits[begin:begin + _POSITIONS_PER_CHUNK].float()  # (k, V)
        if temperature != 1.0:
            z = z / temperature
        log_p = torch.log_softmax(z, dim=-1)  # (k, V)
        chunks_lp.append(log_p.gather(-1, targets[begin:begin + _POSITIONS_PER_CHUNK, None]).squeeze(-1))  # (k,)
        if entropy is not None:
            chunks_ent.append(-(log_p.exp() * log_p).sum(dim=-1))  # (k,)
    logprobs = logprobs.index_put(where, torch.cat(chunks_lp))  # (B, A)
    if entropy is not None:
        entropy = entropy.index_put(where, torch.cat(chunks_ent))  # (B, A)
    return logprobs, entropy
