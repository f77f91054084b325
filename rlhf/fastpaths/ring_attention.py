"""Sequence parallelism (``--ring-attn-size N``): each sequence split over the N ranks of a ring group.

The N ranks of a ring group (consecutive ranks, `rlhf.core.distributed.RingGroup`) hold the same
micro-batch. Its tokens are laid out as rows of length L (padded: the batch's (B, T) rows, T
rounded up to a multiple of N; packed: every sequence's real tokens end to end in one row, as
`rlhf.fastpaths.packing.pack_rows` lays them, rounded up likewise), and rank r runs the model on
the contiguous columns ``r·L/N .. (r+1)·L/N`` only, with the tokens' global position ids. Every
layer's attention is `ring_attention`: the keys and values of the whole row are gathered from the
ring (``--ring-head-stride S`` key/value heads at a time, which bounds the gathered memory) and
each local query attends to the keys before it in its own sequence (causal, padding and packed
boundaries in one boolean mask), so the result is the one-process forward's up to float rounding.
Gradients go back through the gather: the gradient of the gathered keys and values is summed over
the ring and each rank keeps its own slice's.

Outputs: `RingModel.token_logprobs` computes the log-probs of the local positions (a position's
next token is read from the full ``input_ids`` every rank holds, so the label at a slice boundary
is the next slice's first token) and `ring_sum` adds the ranks' (B, A) results, zero off their
own positions; calling the model gives its (B, T, ...) output the same way. Every rank of the ring
then computes the same loss from the same whole tensor; `ring_sum`'s backward hands each rank the
gradient of its own positions only, so the ranks' parameter gradients add up (the backends'
all-reduce over every rank) to the gradient of the loss, once.

On CUDA with the ``ring_flash_attn`` package installed, packed batches use its variable-length
kernel that gathers keys and values the same way (``llama3_flash_attn_varlen_func``), with the
same head stride. That path is unverified here (no GPU in CI); the torch path (CPU, gloo) is
tested against plain attention (tests/fastpaths/test_ring_attention.py).

Shape legend: ``B`` sequences, ``T`` tokens, ``A = T - 1``, ``R`` rows of the layout (B padded, 1
packed), ``L`` their length, ``l = L / N`` a rank's columns, ``H``/``K`` query/key-value heads,
``D`` head size, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.core.logprobs import OwnLogprobs, deferred_head, hidden_states_out, scatter_logprobs
from rlhf.core.modeling import innermost

IMPLEMENTATION = "rlhf_ring"  # the name under transformers' attention interface


@dataclass(frozen=True)
class RingLayout:
    """How a micro-batch's tokens lie over the ring (built by `RingModel`)."""

    group: Any  # the ring's process group
    size: int  # N
    rank: int  # this rank's place in the ring
    head_stride: int  # key/value heads gathered at a time
    input_ids: torch.Tensor  # (R, L)
    position_ids: torch.Tensor  # (R, L) each token's position in its own sequence
    segment: torch.Tensor  # (R, L) the sequence a token belongs to; -1 on padding
    index: torch.Tensor  # (B, T) where each batch position lies, as a flat index into (R·L); -1 on padding

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]  # L

    @property
    def columns(self) -> tuple[int, int]:
        """This rank's columns ``[start, stop)``."""
        local = self.length // self.size
        return self.rank * local, (self.rank + 1) * local


_ACTIVE: contextvars.ContextVar[RingLayout | None] = contextvars.ContextVar("ring_layout", default=None)


# --- collectives with the gradients sequence parallelism needs -------------------------------------


class _GatherColumns(torch.autograd.Function):
    """(R, h, l, D) on each rank -> (R, h, L, D), the ranks' columns in ring order. Backward: the
    gradient of the whole is summed over the ring (every rank's queries read every slice) and each
    rank keeps its own columns."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.width = group, rank, local.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad[:, :, ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width], None, None, None


class _RingSum(torch.autograd.Function):
    """The sum of a tensor over the ring. Backward: the incoming gradient unchanged, because every
    rank computes the same loss from the same sum: each rank's part gets that loss's gradient once."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        total = part.clone().contiguous()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def ring_sum(part: torch.Tensor, layout: RingLayout) -> torch.Tensor:
    return _RingSum.apply(part, layout.group)


def gather_columns(local: torch.Tensor, layout: RingLayout) -> torch.Tensor:
    return _GatherColumns.apply(local, layout.group, layout.size, layout.rank)


# --- the attention -----------------------------------------------------------------------------


def ring_mask(layout: RingLayout, sliding_window: int | None = None) -> torch.Tensor:
    """(R, l, L): local query i sees key j when j is not after i, both are in the same sequence and
    j is a real token (within ``sliding_window`` tokens when given); every query sees itself, so a
    padding query has no empty row (its output is never read)."""
    start, stop = layout.columns
    device = layout.segment.device
    queries = torch.arange(start, stop, device=device)  # (l,)
    keys = torch.arange(layout.length, device=device)  # (L,)
    seen = keys[None, :] <= queries[:, None]  # (l, L)
    if sliding_window is not None:
        seen &= keys[None, :] > queries[:, None] - sliding_window
    own = layout.segment[:, start:stop]  # (R, l)
    same = (own[:, :, None] == layout.segment[:, None, :]) & (layout.segment[:, None, :] >= 0)  # (R, l, L)
    itself = keys[None, :] == queries[:, None]  # (l, L)
    return (same & seen[None]) | itself[None]


def ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (R, H, l, D), key and value (R, K, l, D) of
    this rank's columns -> (R, l, H, D). The mask transformers builds is not used (it only knows the
    local columns); the layout of the forward in progress (`RingModel`) gives the whole rows'."""
    layout = _ACTIVE.get()
    if layout is None:
        raise RuntimeError("ring attention called outside a RingModel forward")
    heads, kv_heads = query.shape[1], key.shape[1]
    group_size = heads // kv_heads  # query heads per key/value head
    dropout = dropout if module.training else 0.0
    if _flash_ring_usable(query, layout):
        return _flash_ring(query, key, value, layout, scaling, dropout, kwargs.get("sliding_window")), None
    mask = ring_mask(layout, kwargs.get("sliding_window"))[:, None]  # (R, 1, l, L)
    outputs = []
    for first in range(0, kv_heads, layout.head_stride):  # S key/value heads, and their query heads, at a time
        last = min(first + layout.head_stride, kv_heads)
        keys = gather_columns(key[:, first:last], layout)  # (R, S, L, D)
        values = gather_columns(value[:, first:last], layout)  # (R, S, L, D)
        queries = query[:, first * group_size:last * group_size]  # (R, S·g, l, D)
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling,
            enable_gqa=group_size > 1))  # (R, S·g, l, D)
    return torch.cat(outputs, dim=1).transpose(1, 2).contiguous(), None  # (R, l, H, D)


def _flash_ring_usable(query: torch.Tensor, layout: RingLayout) -> bool:
    """The ``ring_flash_attn`` kernel: CUDA, half precision, one packed row. Unverified (no GPU in CI)."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16) or layout.input_ids.shape[0] != 1:
        return False
    import importlib.util

    return importlib.util.find_spec("ring_flash_attn") is not None


def _flash_ring(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: RingLayout,
                scaling: float | None, dropout: float, sliding_window: int | None) -> torch.Tensor:
    """(1, l, H, D) through ring_flash_attn's variable-length kernel (unverified: needs a GPU)."""
    from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func

    segment = layout.segment[0]  # (L,) padding at the end counts as one more sequence
    starts = torch.ones_like(segment, dtype=torch.bool)
    starts[1:] = segment[1:] != segment[:-1]
    cu_seqlens = torch.cat([starts.nonzero().squeeze(1), segment.new_tensor([layout.length])]).to(torch.int32)
    cu_q, cu_k, max_q, max_k, local_k_slice = llama3_flash_attn_prepare_cu_seqlens(
        cu_seqlens, causal=True, rank=layout.rank, world_size=layout.size)
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
    out = llama3_flash_attn_varlen_func(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q, cu_k, max_q, max_k,
        heads_k_stride=layout.head_stride, local_k_slice=local_k_slice, dropout_p=dropout, softmax_scale=scaling,
        causal=True, window_size=window, group=layout.group)  # (l, H, D)
    return out[None]


def register() -> None:
    """Add `ring_attention` to transformers' attention functions (once; idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, ring_attention)


# --- the model wrapper ---------------------------------------------------------------------------


def _decoder(model: Any) -> torch.nn.Module:
    """The outermost transformers model under ``model``'s wrappers that takes ``position_ids``
    (a causal LM, or a value model's backbone)."""
    from transformers import PreTrainedModel

    from rlhf.fastpaths.packing import accepts_position_ids

    for module in innermost(model).modules():
        if isinstance(module, PreTrainedModel) and accepts_position_ids(type(module)):
            return module
    raise TypeError(f"{type(innermost(model)).__name__} holds no transformers model that takes position_ids; "
                    "--ring-attn-size needs one")


@contextlib.contextmanager
def _ring_forward(model: Any, layout: RingLayout, position_ids: torch.Tensor) -> Iterator[None]:
    """Within it, ``model``'s forwards run with ring attention, the layout's local position ids and
    no attention mask (the layout holds it)."""
    register()
    decoder = _decoder(model)
    configs = {id(c): c for m in decoder.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation")}
    before = {key: config._attn_implementation for key, config in configs.items()}

    def with_positions(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "position_ids": position_ids, "attention_mask": None, "use_cache": False}

    hook = decoder.register_forward_pre_hook(with_positions, with_kwargs=True)
    token = _ACTIVE.set(layout)
    try:
        for config in configs.values():
            config._attn_implementation = IMPLEMENTATION
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]
        _ACTIVE.reset(token)
        hook.remove()


class RingModel(OwnLogprobs):
    """``model`` called with padded (B, T) batches and run over the ring (module docstring):
    `token_logprobs` and the call give what the model gives in one process. ``packed``: the
    batch's sequences laid end to end (``--packing``), else its padded rows."""

    runs_own_logprobs = True
    # Whoever calls it for the whole output gets logits, never hidden states to project itself
    # (`rlhf.core.logprobs.deferred_head` finds no deferring output layer here): an output layer
    # applied after the ring sum would run on every rank of the ring and count its gradient N times.
    module = None

    def __init__(self, model: Any, ring: Any, *, packed: bool = False):
        self.model, self.ring, self.packed = model, ring, packed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)

    def get_base_model(self) -> RingModel:
        return self

    def get_output_embeddings(self) -> None:
        return None

    def layout(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RingLayout:
        """The micro-batch's tokens as rows whose length is a multiple of the ring size."""
        size = self.ring.size
        real = attention_mask.bool()  # (B, T)
        if self.packed:
            from rlhf.fastpaths.packing import pack_rows

            packed = pack_rows(input_ids, attention_mask)
            rows_of = torch.arange(real.shape[0], device=real.device)[:, None].expand_as(real)[real][None]  # (1, N)
            ids, positions, segment, index = packed.input_ids, packed.position_ids, rows_of, packed.index
        else:
            batch, length = input_ids.shape
            ids, segment = input_ids, torch.where(real, 0, -1)  # (B, T)
            positions = torch.arange(length, device=ids.device)[None].expand(batch, length)  # (B, T) as unpacked
            flat = torch.arange(batch * length, device=ids.device).view(batch, length)  # (B, T)
            index = torch.where(real, flat, -1)
        extra = -ids.shape[1] % size
        if extra:
            ids = torch.nn.functional.pad(ids, (0, extra))
            positions = torch.nn.functional.pad(positions, (0, extra))
            segment = torch.nn.functional.pad(segment, (0, extra), value=-1)
            if not self.packed:  # flat indices into the wider rows
                rows = torch.arange(index.shape[0], device=index.device)[:, None]
                index = torch.where(index >= 0, index + rows * extra, -1)
        return RingLayout(group=self.ring.group, size=size, rank=self.ring.rank, head_stride=self.ring.head_stride,
                          input_ids=ids, position_ids=positions, segment=segment, index=index)

    def _run(self, layout: RingLayout, **kwargs: Any) -> Any:
        start, stop = layout.columns
        with _ring_forward(self.model, layout, layout.position_ids[:, start:stop]):
            return self.model(input_ids=layout.input_ids[:, start:stop], attention_mask=None, **kwargs)

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> Any:
        """The model's output for the whole (B, T) batch on every rank of the ring: a tensor
        (B, T, ...), or an output whose ``.logits`` is (B, T, V)."""
        if input_ids is None or attention_mask is None:
            raise TypeError("a RingModel is called with input_ids and attention_mask")
        keep = kwargs.pop("logits_to_keep", 0)
        kwargs.pop("use_cache", None)
        layout = self.layout(input_ids, attention_mask)
        output = self._run(layout, **kwargs)
        local = output if isinstance(output, torch.Tensor) else output.logits  # (R, l, ...)
        whole = self._whole(local, layout, attention_mask.shape)  # (B, T, ...)
        whole = whole[:, -keep:] if keep else whole
        if isinstance(output, torch.Tensor):
            return whole
        output.logits = whole
        return output

    def _whole(self, local: torch.Tensor, layout: RingLayout, shape: torch.Size) -> torch.Tensor:
        """(R, l, ...) per local column -> (B, T, ...) on every rank (zero on padding)."""
        start, stop = layout.columns
        rows = local.new_zeros((local.shape[0], layout.length, *local.shape[2:]))  # (R, L, ...)
        rows = torch.cat([rows[:, :start], local, rows[:, stop:]], dim=1)
        rows = ring_sum(rows, layout).flatten(0, 1)  # (R·L, ...)
        real = layout.index >= 0  # (B, T)
        out = local.new_zeros((*shape, *local.shape[2:]))  # (B, T, ...)
        return out.index_put((real,), rows[layout.index[real]])

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor, *,
                       temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`rlhf.core.logprobs.token_logprobs` over the ring: each rank projects its own action
        positions, (B, A) results summed over the ring; 0 off the action mask."""
        batch_size, length = input_ids.shape  # (B, T)
        layout = self.layout(input_ids, attention_mask)
        start, stop = layout.columns
        wanted = action_mask.bool() & (layout.index[:, :-1] >= 0)  # (B, A) predicted from a real token
        rows, cols = wanted.nonzero(as_tuple=True)  # (K,), (K,)
        at = layout.index[rows, cols]  # (K,) flat positions whose outputs predict the action tokens
        column = at % layout.length  # (K,)
        mine = (column >= start) & (column < stop)  # (K,) on this rank's columns
        rows, cols, at, column = rows[mine], cols[mine], at[mine], column[mine]  # (k,)
        head = deferred_head(self.model)
        with hidden_states_out(head):  # with a deferred head: hidden states (..., H) instead of logits
            local = self._run(layout).logits  # (R, l, V) or (R, l, H)
        logprobs = torch.zeros((batch_size, length - 1), dtype=torch.float32, device=input_ids.device)  # (B, A)
        entropy = torch.zeros_like(logprobs) if with_entropy else None
        if rows.numel():
            picked = local[at // layout.length, column - start]  # (k, V)
            logprobs, entropy = scatter_logprobs(picked, input_ids[rows, cols + 1], (rows, cols), logprobs, entropy,
                                                 temperature, head)
        else:  # nothing to score here, but the backward must still run this rank's layers (their collectives)
            tie = local.sum() * 0.0
            logprobs = logprobs + tie
            entropy = entropy + tie if entropy is not None else None
        logprobs = ring_sum(logprobs, layout)
        return logprobs, ring_sum(entropy, layout) if entropy is not None else None


def check_model(model: Any, head_stride: int) -> None:
    """A model ``--ring-attn-size`` can run: a transformers model that takes position ids, whose
    key/value heads the head stride divides."""
    from rlhf.core.errors import ConfigError

    try:
        decoder = _decoder(model)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    config = decoder.config
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    if kv_heads and kv_heads % head_stride:
        raise ConfigError(f"--ring-head-stride {head_stride} must divide the model's {kv_heads} key/value heads")
    if any(getattr(m, "gradient_checkpointing", False) for m in decoder.modules()):
        raise ConfigError("--ring-attn-size does not work with --gradient-checkpointing yet (the recomputed layers "
                          "would run outside the ring); drop one of them")
