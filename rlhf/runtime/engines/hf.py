"""The ``hf`` rollout engine: batched ``model.generate`` with a KV cache, in-process.

It samples from the policy module itself (no weight copy, so no sync after an optimizer step),
with left padding, per-sequence EOS stops, stop strings for multi-turn environments, and the
n samples of each prompt laid out contiguously. Sampling uses only temperature and top-p
(transformers' default top-k of 50 is switched off), so the distribution sampled from is the
one the trainer's log-probs describe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.core.rollout import Generation, SamplingParams


@dataclass(kw_only=True)
class HFEngineConfig:
    generation_batch_size: int | None = field(
        default=None, metadata={"help": "Prompts per generate call (None: all at once)"})


class HFEngine:
    """Generates with the policy's own weights (``shares_weights``: nothing to sync)."""

    shares_weights = True

    def __init__(self, model: torch.nn.Module, tokenizer: Any, config: HFEngineConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or HFEngineConfig()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, n: int, params: SamplingParams) -> list[Generation]:
        """``n`` completions per prompt, as ``[p0s0 .. p0s(n-1), p1s0, ...]``."""
        step = self.config.generation_batch_size or len(prompts)
        out: list[Generation] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for begin in range(0, len(prompts), step):
                out += self._generate_chunk(prompts[begin:begin + step], n, params)
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Generation]:
        from transformers import GenerationConfig

        rows = [ids for ids in prompts for _ in range(n)]  # n copies of each prompt, contiguous
        width = max(len(p) for p in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (P*n, L) left-padded
        attention_mask = torch.zeros_like(input_ids)  # (P*n, L)
        for row, ids in enumerate(rows):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        config = GenerationConfig(
            do_sample=params.temperature > 0, temperature=params.temperature if params.temperature > 0 else None,
            top_p=params.top_p, top_k=0, max_new_tokens=params.max_new_tokens,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids), use_cache=True,
            stop_strings=list(params.stop) or None, return_dict_in_generate=True,
            output_scores=params.return_logprobs,
        )
        extra = {"tokenizer": self.tokenizer} if params.stop else {}
        result = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                     generation_config=config, **extra)
        completions = result.sequences[:, width:].cpu()  # (P*n, L') generated part, padded after the end
        logprobs = None
        if params.return_logprobs:
            scores = torch.stack(result.scores, dim=1).float().cpu()  # (P*n, L', V) processed logits
            logprobs = torch.log_softmax(scores, dim=-1).gather(-1, completions[:, :, None]).squeeze(-1)  # (P*n, L')
        return [self._to_generation(completions[row], logprobs[row] if logprobs is not None else None, params)
                for row in range(completions.shape[0])]

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
