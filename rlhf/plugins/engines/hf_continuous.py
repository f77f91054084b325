"""Continuous batching for the ``hf`` engine: requests join and leave one running decode batch.

A multi-turn rollout sends each trajectory's turns as requests of their own
(`HFEngine.generate_one`, the contract in `rlhf.core.protocols.rollout.batches_continuously`). One
`DecodeBatch` per event loop decodes every request in flight, a token per row per step:

    loop while requests wait or decode:
        admit the waiting requests: prefill them together (left padded), merge their KV cache
            into the batch's (both left padded to the longer, leading columns no row uses dropped)
        sample one token for every row: the rows' processed logits, an inverse-CDF draw from
            the row's own random stream (seeded by the request's ``seed``)
        rows that end (EOS, a stop string, their budget) leave: their request gets its Generation
        one forward of the model over the rows left, with the cache, a mask and each row's position
        yield to the event loop (a trajectory whose tool call returned submits its next turn)

So a trajectory's next turn starts one decode step after its tool call returns, instead of when
the slowest trajectory of the batch is done. What a request samples is a function of its own
prompt, its seed and the model, not of the requests beside it, up to the float rounding of a
forward over a different batch (padding and batch size change the summation order). A forward
that raises, the joining requests' prefill or a decode step, fails with that error every request
decoding or being admitted, and those waiting to join: none is left waiting.

Every row is left padded to the batch's width, so the model sees the layout of an ordinary
batched generation: real tokens right-aligned, explicit position ids, a key mask. Decoding goes
through the model's forward (the lean step of the turn-batched decoder assumes a fixed batch).
Each admission copies the batch's cache once (a contiguous cache, not vLLM's pages), so
requests that arrive together join together. Supported where the direct decoder is: a decoder-only model without its own input preparation,
whose ``DynamicCache`` keeps plain per-layer keys and values (no sliding window); elsewhere the
rollout batches by turns.

Shape legend: ``B`` rows decoding, ``J`` rows joining, ``L`` cached positions, ``K`` key-value
heads, ``D`` head size, ``V`` vocabulary.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.api import Generation, SamplingParams, accepts_logits_to_keep, base_model, cache_argument, cache_tensors
from rlhf.plugins.engines.sampling import DecodeSoftmax, inverse_cdf


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    stream: torch.Generator | None  # the request's own random numbers (None: the process's)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    on_token: Any = None  # called with (token id, log-prob, top alternatives) as each token is sampled
    top_logprobs: int = 0  # how many alternatives (of the sampling distribution) each token reports
    tops: list[list[tuple[int, float]]] = field(default_factory=list)


def sampling_key(params: SamplingParams) -> tuple:
    """The fields that shape the distribution (rows sharing them are processed together)."""
    return params.temperature, params.top_p, params.top_k, params.repetition_penalty


class DecodeBatch:
    """The requests of one event loop decoding together on one `HFEngine` (see the module docstring)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.waiting: list[_Request] = []
        self.rows: list[_Request] = []  # decoding, in row order
        self.task: asyncio.Task | None = None
        self.cache: Any = None  # DynamicCache, (B, K, L, D) per layer
        self.mask: torch.Tensor | None = None  # (B, L) 1 on real tokens
        self.positions: torch.Tensor | None = None  # (B, 1) the position of each row's next token
        self.logits: torch.Tensor | None = None  # (B, V) each row's next-token logits
        self.seen: torch.Tensor | None = None  # (B, V) tokens each row holds (repetition penalty)
        self.softmax = DecodeSoftmax()  # one buffer for the distributions while the loop decodes
        self.log_softmax = DecodeSoftmax(log=True)  # and one for their logarithms

    async def submit(self, prompt: list[int], params: SamplingParams, *, on_token: Any = None,
                     top_logprobs: int = 0) -> Generation:
        loop = asyncio.get_running_loop()
        stream = None
        if params.seed is not None:
            stream = torch.Generator()
            stream.manual_seed(int(params.seed) % (2 ** 63))
        request = _Request(list(prompt), params, loop.create_future(), stream, on_token=on_token,
                           top_logprobs=top_logprobs)
        self.waiting.append(request)
        if self.task is None or self.task.done():
            self.task = loop.create_task(self._run())
        return await request.future

    async def _run(self) -> None:
        model = self.engine.model
        was_training = model.training
        model.eval()
        joining: list[_Request] = []  # out of `waiting` and not yet in `rows` while their prefill runs
        try:
            capacity = self.engine.config.generation_batch_size
            while self.waiting or self.rows:
                self._drop_cancelled()
                with torch.inference_mode():
                    self.waiting = [r for r in self.waiting if not r.future.done()]
                    room = len(self.waiting) if capacity is None else max(0, capacity - len(self.rows))
                    if self.waiting and room:
                        joining, self.waiting = self.waiting[:room], self.waiting[room:]
                        self._admit(joining)
                        joining = []
                    if self.rows:
                        self._step()
                await asyncio.sleep(0)  # let trajectories whose tool calls returned submit their next turn
        except BaseException as exc:
            for request in joining + self.rows + self.waiting:
                if not request.future.done():
                    request.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError("decoding stopped"))
            self.rows, self.waiting = [], []
            self._reset()
            if not isinstance(exc, Exception):
                raise
        finally:
            model.train(was_training)
            self.softmax, self.log_softmax = DecodeSoftmax(), DecodeSoftmax(log=True)  # the buffers go with the decoding

    def _drop_cancelled(self) -> None:
        """Remove rows whose caller gave up (a cancelled trajectory)."""
        keep = [i for i, r in enumerate(self.rows) if not r.future.done()]
        if len(keep) < len(self.rows):
            self._select(keep)

    def _reset(self) -> None:
        self.cache = self.mask = self.positions = self.logits = self.seen = None

    # --- joining -------------------------------------------------------------------------------

    def _admit(self, joining: list[_Request]) -> None:
        """Prefill the joining requests together and merge them into the batch."""
        engine = self.engine
        base = base_model(engine.model)
        device = engine.device
        width = max(len(r.prompt) for r in joining)
        input_ids = torch.full((len(joining), width), engine.pad_id, dtype=torch.long)  # (J, P) left padded
        mask = torch.zeros_like(input_ids)  # (J, P)
        for row, request in enumerate(joining):
            input_ids[row, width - len(request.prompt):] = torch.tensor(request.prompt)
            mask[row, width - len(request.prompt):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (J, P)
        from transformers import DynamicCache

        cache = DynamicCache(config=base.config)
        keep = {"logits_to_keep": 1} if accepts_logits_to_keep(type(base)) else {}
        logits = engine.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                              **{cache_argument(type(base)): cache, "use_cache": True}, **keep).logits[:, -1]  # (J, V)
        seen = None
        if any(r.params.repetition_penalty != 1.0 for r in joining):
            seen = engine.prompt_tokens(input_ids, mask, logits.shape[-1])  # (J, V)
        self._merge(joining, cache, mask, positions[:, -1:] + 1, logits, seen)

    def _merge(self, joining: list[_Request], cache: Any, mask: torch.Tensor, positions: torch.Tensor,
               logits: torch.Tensor, seen: torch.Tensor | None) -> None:
        new = cache_tensors(cache)
        if new is None:
            raise RuntimeError("this transformers' DynamicCache keeps no per-layer keys and values")
        if not self.rows:
            old_keys, old_values = [None] * len(new[0]), [None] * len(new[1])
            old_mask = mask.new_zeros((0, mask.shape[1]))
        else:
            old_keys, old_values = cache_tensors(self.cache)
            used = self.mask.any(dim=0).nonzero()  # columns some row still reads
            start = int(used[0]) if used.numel() else self.mask.shape[1]
            old_keys = [k[:, :, start:] for k in old_keys]  # leading columns no row uses dropped
            old_values = [v[:, :, start:] for v in old_values]
            old_mask = self.mask[:, start:]
        length = max(old_mask.shape[1], mask.shape[1])
        from transformers import DynamicCache

        merged = DynamicCache(config=base_model(self.engine.model).config)
        for layer, (new_k, new_v) in enumerate(zip(*new)):
            keys = _join_rows(old_keys[layer], new_k, length)  # (B + J, K, L, D)
            values = _join_rows(old_values[layer], new_v, length)
            merged.update(keys, values, layer)
        self.cache = merged
        self.mask = torch.cat([_pad_left(old_mask, length, dim=1), _pad_left(mask, length, dim=1)])  # (B + J, L)
        self.positions = positions if self.positions is None or not self.rows else torch.cat([self.positions, positions])
        self.logits = logits if not self.rows else torch.cat([self.logits, logits])
        if seen is not None or self.seen is not None:
            vocab = logits.shape[-1]
            old_seen = self.seen if self.seen is not None else torch.zeros(
                (len(self.rows), vocab), dtype=torch.bool, device=logits.device)
            new_seen = seen if seen is not None else torch.zeros((len(joining), vocab), dtype=torch.bool,
                                                                  device=logits.device)
            self.seen = torch.cat([old_seen, new_seen])  # (B + J, V)
        self.rows = self.rows + joining

    # --- decoding ------------------------------------------------------------------------------

    def _step(self) -> None:
        """One token for every row; rows that end leave; one forward for the rest."""
        engine = self.engine
        chosen = torch.empty(len(self.rows), dtype=torch.long, device=self.logits.device)  # (B,)
        logprobs = torch.zeros(len(self.rows), dtype=torch.float32, device=self.logits.device)  # (B,)
        tops: dict[int, list[tuple[int, float]]] = {}  # row -> its token's alternatives, where asked
        groups: dict[tuple, list[int]] = {}
        for index, request in enumerate(self.rows):
            groups.setdefault(sampling_key(request.params), []).append(index)
        for indices in groups.values():
            params = self.rows[indices[0]].params
            at = torch.tensor(indices, device=self.logits.device)
            seen = self.seen[at] if self.seen is not None else None
            scores = engine._process(self.logits[at].float(), params, seen)  # (b, V)
            if params.temperature > 0:
                probs = self.softmax(scores)  # (b, V)
                uniforms = torch.stack([torch.rand(1, generator=self.rows[i].stream) for i in indices])  # (b, 1)
                picked = inverse_cdf(probs, uniforms.to(probs.device))  # (b,)
            else:
                picked = scores.argmax(dim=-1)  # (b,)
            chosen[at] = picked
            distribution = self.log_softmax(scores)  # (b, V) what the token was sampled from
            logprobs[at] = distribution.gather(1, picked[:, None]).squeeze(1)
            for local, index in enumerate(indices):
                if self.rows[index].top_logprobs:
                    tops[index] = top_alternatives(distribution[local], self.rows[index].top_logprobs)
        if self.seen is not None:
            self.seen[torch.arange(len(self.rows), device=chosen.device), chosen] = True
        ended = []
        for index, (request, token, logprob) in enumerate(zip(self.rows, chosen.tolist(), logprobs.tolist())):
            request.tokens.append(token)
            request.logprobs.append(logprob)
            if request.top_logprobs:
                request.tops.append(tops[index])
            if request.on_token is not None:
                request.on_token(token, logprob, tops.get(index, []))
            generation = self._ended(request)
            if generation is not None:
                request.future.set_result(generation)
                ended.append(index)
        gone = set(ended)
        stay = [i for i in range(len(self.rows)) if i not in gone]
        if ended:
            chosen = chosen[torch.tensor(stay, dtype=torch.long, device=chosen.device)]
            self._select(stay)
        if not self.rows:
            self._reset()
            return
        base = base_model(engine.model)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)  # (B, L + 1)
        self.logits = engine.model(input_ids=chosen[:, None], attention_mask=self.mask, position_ids=self.positions,
                                   **{cache_argument(type(base)): self.cache, "use_cache": True}).logits[:, -1]
        self.positions = self.positions + 1

    def _ended(self, request: _Request) -> Generation | None:
        """The request's Generation when its last token ended it, else None."""
        params, ids = request.params, request.tokens
        want = params.return_logprobs or params.logprobs_if_free  # computed per token anyway
        extra = {"top_logprobs": list(request.tops)} if request.top_logprobs else {}
        if ids[-1] in self.engine.eos_ids:
            return Generation(token_ids=list(ids), finish_reason="stop", logprobs=list(request.logprobs) if want else None,
                              extra=extra)
        if params.stop:
            cut, stop = self.engine._stop_string_cut(ids, params.stop)
            if cut is not None:
                return Generation(token_ids=ids[:cut], finish_reason="stop", stop_string=stop,
                                  logprobs=request.logprobs[:cut] if want else None,
                                  extra={"top_logprobs": request.tops[:cut]} if request.top_logprobs else {})
        if len(ids) >= params.max_new_tokens:
            return Generation(token_ids=list(ids), finish_reason="length", logprobs=list(request.logprobs) if want else None,
                              extra=extra)
        return None

    def _select(self, keep: list[int]) -> None:
        """Keep these rows (in this order) of every batch tensor."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.positions, self.logits = self.mask[index], self.positions[index], self.logits[index]
        if self.seen is not None:
            self.seen = self.seen[index]


def top_alternatives(distribution: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one row's sampling distribution (V,) log-probs, as (id, log-prob),
    most likely first; tokens the distribution excludes (-inf: outside top-k / top-p) are left out."""
    values, ids = distribution.topk(min(k, distribution.shape[-1]))  # (k,)
    return [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]


def _pad_left(tensor: torch.Tensor, length: int, *, dim: int) -> torch.Tensor:
    """``tensor`` with zeros prepended along ``dim`` up to ``length``."""
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _join_rows(old: torch.Tensor | None, new: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of two caches (B, K, L1, D) and (J, K, L2, D) as one (B + J, K, length, D), left padded."""
    new = _pad_left(new, length, dim=2)
    return new if old is None else torch.cat([_pad_left(old, length, dim=2), new])
