"""The ``hf`` rollout engine: batched sampling with a KV cache, in-process.

It samples from the policy module itself (no weight copy, so no sync after an optimizer step),
with left padding, per-sequence EOS stops, stop strings for multi-turn environments, and the
n samples of each prompt laid out contiguously. It samples the distribution `SamplingParams`
states (repetition penalty, temperature, top-k, top-p, in transformers' order) and nothing else:
settings in the model's own generation config (top-k, repetition penalty, minimum length, ...)
do not apply. The repetition penalty remembers a row's prompt tokens, not its padding.

Two decoders sample the same distribution from the same logits:

* ``direct``: a loop over the model's forward with a ``DynamicCache``. transformers' ``generate``
  spends a fifth of a small model's decode time on per-token machinery (logits-processor and
  stopping-criteria objects, re-preparing inputs, rebuilding masks); this loop does only the
  forward, the sampling and the EOS bookkeeping. On a CPU it samples by inverse CDF, one uniform
  per row, in two levels at large vocabularies (rlhf/plugins/engines/sampling.py). Used when
  there are no stop strings and the model is a plain decoder-only transformers model (no
  model-specific input preparation).
* ``lean``: ``direct`` with each decode step run by `LeanDecoder`
  (rlhf/fastpaths/lean_decode.py): the model's own modules over a cache allocated once,
  without the forward's per-call machinery; the same logits. For Llama-architecture models with
  sdpa attention; ``auto`` uses it there. Each variant of the step (prompts padded or not, their
  caches shared by their rows or copied: `LeanDecoder.path`) runs beside the model's forward for
  its first `LEAN_CHECK_STEPS` decode steps on a model, so the check sees the cache grow, and
  alone once their logits agree; a variant that differs decodes through the forward from then
  on, with a warning (`rlhf.fastpaths.verdicts`).
* ``generate``: ``model.generate``, for stop strings (matched on text across token boundaries)
  and for every other model. Greedy decoding gives the same tokens in both.

Shape legend: ``B`` rows (prompts x n), ``P`` prompt positions (left padded), ``N`` new tokens,
``V`` vocabulary.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from rlhf.api import (Generation, LeanDecodeUnsupported, LeanDecoder, SamplingParams, accepts_logits_to_keep,
                      base_model, cache_argument, fast_path_verdict, lean_decoder_supported, settle_fast_path)
from rlhf.plugins.engines.config import DECODERS, HFEngineConfig
from rlhf.plugins.engines.sampling import DecodeSoftmax, sample_categorical

log = logging.getLogger(__name__)

__all__ = ["HFEngine", "HFEngineConfig", "sample_categorical"]

LEAN_CHECK_STEPS = 4  # decode steps a new lean-step variant runs beside the forward before it runs alone


def _relative_difference(lean_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """max |lean - forward| over (B, V), relative to the logits' scale (at least 1)."""
    return float((lean_logits.float() - logits.float()).abs().max()) / max(1.0, float(logits.float().abs().max()))


def _lean_tolerance(logits: torch.Tensor) -> float:
    return 1e-4 if logits.dtype == torch.float32 else 5e-2


class HFEngine:
    """Generates with the policy's own weights (``shares_weights``: nothing to sync)."""

    shares_weights = True
    many_event_loops = True  # generate_one: a decode batch per event loop (rlhf.core.protocols.rollout)

    def __init__(self, model: torch.nn.Module, tokenizer: Any, config: HFEngineConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or HFEngineConfig()
        if self.config.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(DECODERS)}; got {self.config.decoder!r}")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        if self.config.decoder == "lean" and not lean_decoder_supported(model):
            log.warning("hf engine: decoder 'lean' needs a Llama-architecture model (LlamaForCausalLM, or Qwen2 / "
                        "Mistral without sliding windows) with sdpa attention and the transformers internals it "
                        "reads (rlhf.fastpaths.llama_like); decoding through the model's forward")
        self.warned_lean_unsupported = False
        self.decode_batches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> DecodeBatch

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Nothing to do for the policy's own weights (sampled in place); ``state``: load it into the module."""
        if state is not None:
            self.model.load_state_dict(dict(state), strict=False)

    def generate(self, prompts: list[list[int]], *, n: int, params: SamplingParams) -> list[Generation]:
        """``n`` completions per prompt, as ``[p0s0 .. p0s(n-1), p1s0, ...]``."""
        step = self.config.generation_batch_size or len(prompts)
        out: list[Generation] = []
        was_training = self.model.training
        self.model.eval()
        try:
            # Nothing generated here needs autograd: the trainer rebuilds tensors from token lists.
            # Sharded weights (synced_gpus) are gathered inside forwards and some stay gathered:
            # they must not become inference tensors, which training could not use.
            with torch.no_grad() if self.config.synced_gpus else torch.inference_mode():
                for begin in range(0, len(prompts), step):
                    out += self._generate_chunk(prompts[begin:begin + step], n, params)
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Generation]:
        rows = [ids for ids in prompts for _ in range(n)]  # n copies, contiguous
        direct = self.uses_direct_decoder(params)
        if direct:  # the direct decoder prefills each distinct prompt once, for every row that starts with it
            first: dict[tuple[int, ...], int] = {}
            source = torch.tensor([first.setdefault(tuple(ids), len(first)) for ids in rows])  # (B,) prefill row
            rows = [list(ids) for ids in first]
        width = max(len(p) for p in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (B, P) left-padded
        attention_mask = torch.zeros_like(input_ids)  # (B, P)
        for row, ids in enumerate(rows):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        if direct:
            completions, logprobs = self._decode(input_ids, attention_mask, params, source.to(self.device))
        else:
            completions, logprobs = self._hf_generate(input_ids, attention_mask, params)
        completions = completions.cpu()  # (B, N)
        logprobs = logprobs.cpu() if logprobs is not None else None  # (B, N)
        return [self._to_generation(completions[row], logprobs[row] if logprobs is not None else None, params)
                for row in range(completions.shape[0])]

    # --- continuous batching (multi-turn rollouts) ---------------------------------------------

    def continuous_for(self, params: SamplingParams) -> bool:
        """Whether `generate_one` serves rollouts sampled with ``params``: ``continuous`` on, not the
        ``generate`` decoder or ranks in lockstep, and a model the direct decoder runs whose cache
        keeps plain per-layer keys and values (`rlhf.plugins.engines.hf_continuous`)."""
        if not self.config.continuous or self.config.decoder == "generate" or self.config.synced_gpus:
            return False
        from transformers import DynamicCache, GenerationMixin

        base = base_model(self.model)
        if type(base).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation \
                or base.config.is_encoder_decoder:
            return False
        layers = getattr(DynamicCache(config=base.config), "layers", None)
        return layers is not None and all(type(layer).__name__ == "DynamicLayer" for layer in layers)

    async def generate_one(self, prompt_ids: list[int], params: SamplingParams, *, on_token: Any = None,
                           top_logprobs: int = 0) -> Generation:
        """One completion of ``prompt_ids``, decoded with every other request of this event loop in
        one batch that requests join and leave (`rlhf.plugins.engines.hf_continuous`); ``on_token``
        and ``top_logprobs`` as `rlhf.core.protocols.rollout.ContinuousEngine.generate_one` says."""
        from rlhf.plugins.engines.hf_continuous import DecodeBatch

        loop = asyncio.get_running_loop()
        batch = self.decode_batches.get(loop)
        if batch is None:
            batch = self.decode_batches[loop] = DecodeBatch(self)
        return await batch.submit(prompt_ids, params, on_token=on_token, top_logprobs=top_logprobs)

    # --- decoders -----------------------------------------------------------------------------

    def uses_direct_decoder(self, params: SamplingParams) -> bool:
        if self.config.decoder != "auto":
            return self.config.decoder in ("direct", "lean")
        from transformers import GenerationMixin

        base = base_model(self.model)  # PEFT
        plain = type(base).prepare_inputs_for_generation is GenerationMixin.prepare_inputs_for_generation
        return not params.stop and plain and not base.config.is_encoder_decoder

    def _decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                source: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The direct decoder: (B, N) tokens, padded after EOS, and (B, N) log-probs if asked.

        ``input_ids`` (U, P) holds each distinct prompt once and ``source`` (B,) names the prompt
        each output row continues (None: row b continues prompt b). A prompt is prefilled once and
        its KV cache copied to its rows, which saves (B - U) / B of the prefill: most of the work
        with long prompts, whether the n samples of a prompt come in one call (``n``) or as rows
        of their own (the rollout's trajectories).
        """
        from transformers import DynamicCache

        base = base_model(self.model)
        cache = DynamicCache(config=base.config)
        positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (U, P), left padding starts at 0
        keep = {"logits_to_keep": 1} if accepts_logits_to_keep(type(base)) else {}  # the prompt needs no logits
        cached = {cache_argument(type(base)): cache, "use_cache": True}
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                            **cached, **keep).logits[:, -1]  # (U, V)
        # The lean step keeps a prompt's cache once for its rows; the model's forward needs a row each.
        lean = self._lean_decoder(cache, attention_mask, params.max_new_tokens, source)
        # A variant of the lean step not yet checked on this model runs beside the forward for its
        # first LEAN_CHECK_STEPS steps (the cache growing), then alone if their logits agree.
        checking = lean is not None and fast_path_verdict(base, lean.path) is None
        to_check, worst = min(LEAN_CHECK_STEPS, params.max_new_tokens - 1), 0.0
        if source is not None and not torch.equal(source, torch.arange(len(source), device=source.device)):
            if lean is None or checking:
                cache.batch_select_indices(source)
            logits, positions = logits[source], positions[source]  # (B, V), (B, P)
            input_ids, attention_mask = input_ids[source], attention_mask[source]  # (B, P)
        batch_size = input_ids.shape[0]
        mask = torch.cat([attention_mask, attention_mask.new_ones((batch_size, params.max_new_tokens))], dim=1)
        next_position = positions[:, -1:] + 1  # (B, 1)
        eos = torch.tensor(sorted(self.eos_ids), device=input_ids.device)
        tokens = input_ids.new_full((batch_size, params.max_new_tokens), self.pad_id)  # (B, N)
        logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device) \
            if params.return_logprobs or params.logprobs_if_free else None  # (B, N)
        finished = torch.zeros(batch_size, dtype=torch.bool, device=input_ids.device)  # (B,)
        width = input_ids.shape[1]
        seen = prompt_tokens(input_ids, attention_mask, logits.shape[-1]) \
            if params.repetition_penalty != 1.0 else None  # (B, V)
        # Log-probs only tokens.jsonl reads (``logprobs_if_free``, the update never sees them) come from
        # the sampling distribution itself: log p[chosen], not a log_softmax over (B, V) per token.
        # Within 1e-6 of it; a loss that reads them (``return_logprobs``) gets the log_softmax.
        from_probs = not params.return_logprobs
        softmax, log_softmax = DecodeSoftmax(), DecodeSoftmax(log=True)  # a (B, V) buffer each for the decode
        for t in range(params.max_new_tokens):
            scores = self._process(logits.float(), params, seen)  # (B, V)
            probs = None
            if params.temperature > 0:
                probs = softmax(scores)  # (B, V), overwritten by the next token's
                chosen = sample_categorical(probs)  # (B,)
            else:
                chosen = scores.argmax(dim=-1)  # (B,)
            chosen = chosen.masked_fill(finished, self.pad_id)  # rows that ended keep padding
            tokens[:, t] = chosen
            if seen is not None:
                seen[torch.arange(batch_size, device=seen.device), chosen] = True
            if logprobs is not None and from_probs and probs is not None:
                logprobs[:, t] = probs.gather(1, chosen[:, None]).squeeze(1).log()  # (B,)
            elif logprobs is not None:
                logprobs[:, t] = log_softmax(scores).gather(1, chosen[:, None]).squeeze(1)
            finished |= torch.isin(chosen, eos)
            if t + 1 == params.max_new_tokens or self._all_finished(finished):
                return tokens[:, : t + 1], (logprobs[:, : t + 1] if logprobs is not None else None)
            if lean is not None and not checking:
                logits = lean.step(chosen, next_position)  # (B, V)
            else:
                logits = self.model(input_ids=chosen[:, None], attention_mask=mask[:, : width + t + 1],
                                    position_ids=next_position, **cached).logits[:, -1]
                if checking:
                    difference = _relative_difference(lean.step(chosen, next_position), logits)
                    worst = difference if not difference <= worst else worst  # a NaN stays
                    if t + 1 >= to_check or not worst <= _lean_tolerance(logits):
                        tolerance = _lean_tolerance(logits)
                        checking = False
                        if not settle_fast_path(base, lean.path, worst, tolerance, who="hf engine",
                                                switch="--engine.decoder direct"):
                            lean = None
            next_position = next_position + 1
        return tokens, logprobs

    def uses_lean_step(self) -> bool:
        """Decode steps by `LeanDecoder`: decoder auto or lean, a supported model, not in lockstep
        over ranks (sharded weights gather inside the model's forward). Each variant of the step
        (`LeanDecoder.path`) is checked against the forward on its first use on the model and not
        taken again if it differs."""
        return (self.config.decoder in ("auto", "lean") and not self.config.synced_gpus
                and lean_decoder_supported(self.model))

    def _lean_decoder(self, cache: Any, key_mask: torch.Tensor, new_tokens: int,
                      source: torch.Tensor | None) -> LeanDecoder | None:
        """The lean step over this prefill, or None: not used, not supported by the installed
        transformers (a warning, once), or its variant found to differ on this model."""
        if not self.uses_lean_step():
            return None
        try:
            lean = LeanDecoder(self.model, cache, key_mask, new_tokens, source, pack_head=self.config.pack_head,
                               block_head=self.config.block_head)
        except LeanDecodeUnsupported as exc:
            if not self.warned_lean_unsupported:
                log.warning("hf engine: the lean decode step cannot run here (%s); decoding through the model's "
                            "forward", exc)
                self.warned_lean_unsupported = True
            return None
        return lean if fast_path_verdict(base_model(self.model), lean.path) is not False else None

    def _all_finished(self, finished: torch.Tensor) -> bool:
        """Every row has ended; with ``synced_gpus``, on every rank (a rank that is done keeps decoding padding)."""
        if not self.config.synced_gpus:
            return bool(finished.all())
        import torch.distributed as dist

        done = finished.all().to(torch.int32)  # () 1 when this rank is done
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done)

    @staticmethod
    def prompt_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab: int) -> torch.Tensor:
        """(B, V) True where row b's prompt holds token v (`prompt_tokens`)."""
        return prompt_tokens(input_ids, attention_mask, vocab)

    @staticmethod
    def _process(scores: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
        """The repetition penalty (``seen`` (B, V): the tokens each row holds), temperature, top-k,
        then top-p: the distribution sampled from (and the engine's log-probs). (B, V)"""
        if seen is not None and params.repetition_penalty != 1.0:
            scores = penalize_repetitions(scores, seen, params.repetition_penalty)
        if params.temperature <= 0:
            return scores  # greedy: the (penalised) logits, as generate reports them
        if params.temperature != 1.0:
            scores = scores / params.temperature
        if 0 < params.top_k < scores.shape[-1]:
            kth = scores.topk(params.top_k, dim=-1).values[:, -1:]  # (B, 1) the k-th largest
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            # Keep the smallest set of most likely tokens whose mass reaches top_p (at least one).
            ascending, order = scores.sort(dim=-1)  # (B, V)
            mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)  # (B, V)
            drop = mass_below <= 1.0 - params.top_p
            drop[:, -1] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return scores

    def _hf_generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=params.temperature > 0, temperature=params.temperature if params.temperature > 0 else None,
            top_p=params.top_p, top_k=params.top_k, max_new_tokens=params.max_new_tokens,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids), use_cache=True,
            stop_strings=list(params.stop) or None, return_dict_in_generate=True,
            output_scores=params.return_logprobs,
            num_beams=1, repetition_penalty=1.0, min_new_tokens=0, no_repeat_ngram_size=0,
            typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
        )
        extra: dict[str, Any] = {"tokenizer": self.tokenizer} if params.stop else {}
        if params.repetition_penalty != 1.0:  # transformers' own would penalise the padding tokens too
            from transformers import LogitsProcessorList

            extra["logits_processor"] = LogitsProcessorList([_RepetitionPenalty(input_ids, attention_mask,
                                                                                params.repetition_penalty)])
        # generate fills the fields a passed config leaves at their default (transformers 4.x: any
        # field equal to its default, repetition_penalty=1.0 included) from the model's own
        # generation config; with that config swapped for this one, nothing of the checkpoint's
        # sampling settings reaches the distribution sampled from.
        base = base_model(self.model)
        own = base.generation_config
        base.generation_config = config
        try:
            result = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                         synced_gpus=self.config.synced_gpus, **extra)
        finally:
            base.generation_config = own
        completions = result.sequences[:, input_ids.shape[1]:]  # (B, N) generated part, padded after the end
        logprobs = None
        if params.return_logprobs:
            # one step's (B, V) processed logits at a time: no (B, N, V) float32 copy
            logprobs = torch.stack([torch.log_softmax(scores.float(), dim=-1).gather(-1, completions[:, t, None])
                                    .squeeze(-1) for t, scores in enumerate(result.scores)], dim=1)  # (B, N)
        return completions, logprobs

    # --- results ------------------------------------------------------------------------------

    def _to_generation(self, tokens: torch.Tensor, logprobs: torch.Tensor | None, params: SamplingParams) -> Generation:
        ids = tokens.tolist()
        eos_at = next((i for i, token in enumerate(ids) if token in self.eos_ids), None)
        cut, stop_string = self._stop_string_cut(ids[: eos_at], params.stop) if params.stop else (None, None)
        if cut is not None:
            # a stop string ended this sequence; generate padded it afterwards
            ids, finish = ids[:cut], "stop"
        elif eos_at is not None:
            ids, finish = ids[: eos_at + 1], "stop"  # the EOS token is part of the action
        else:
            finish = "length"
        lp = logprobs[: len(ids)].tolist() if logprobs is not None else None
        return Generation(token_ids=ids, finish_reason=finish, logprobs=lp, stop_string=stop_string)

    def _stop_string_cut(self, ids: list[int], stops: tuple[str, ...]) -> tuple[int | None, str | None]:
        """The shortest token prefix whose text contains a stop string (binary search on decodes)."""
        decode = lambda k: self.tokenizer.decode(ids[:k], skip_special_tokens=False)  # noqa: E731
        text = decode(len(ids))
        found = [(text.find(stop) + len(stop), stop) for stop in stops if stop in text]
        if not found:
            return None, None
        end_char, stop = min(found)
        low, high = 1, len(ids)
        while low < high:  # smallest k with len(decode(k)) >= end_char and the stop inside
            mid = (low + high) // 2
            if stop in decode(mid):
                high = mid
            else:
                low = mid + 1
        return low, stop


def prompt_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) True where row b's prompt holds token v (its padding left out)."""
    counts = torch.zeros((input_ids.shape[0], vocab), dtype=torch.int32, device=input_ids.device)
    return counts.scatter_add_(1, input_ids, attention_mask.to(torch.int32)) > 0  # (B, V)


def penalize_repetitions(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: a logit of a token the row holds is divided by ``penalty``
    when positive, multiplied by it otherwise. scores, seen: (B, V)."""
    return torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)


class _RepetitionPenalty:
    """`penalize_repetitions` as a transformers logits processor for the ``generate`` decoder: it
    remembers the prompt tokens (not the padding) and adds each generated token."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, penalty: float):
        self.prompt_length, self.penalty = input_ids.shape[1], penalty
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.seen: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.seen is None:
            self.seen = prompt_tokens(self.input_ids, self.attention_mask, scores.shape[-1])  # (B, V)
        if input_ids.shape[1] > self.prompt_length:
            self.seen[torch.arange(input_ids.shape[0], device=input_ids.device), input_ids[:, -1]] = True
        return penalize_repetitions(scores, self.seen, self.penalty)

