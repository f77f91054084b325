"""Contract of a rollout engine (``register_rollout_engines``), on a tiny random Llama.

``generate(prompts, n=3, params)`` returns ``n`` `Generation` per prompt, within
``max_new_tokens``, with a valid finish reason and nothing after EOS; with ``return_logprobs``
one finite log-prob <= 0 per token; a run of stop strings ends every completion at the first one
(no stop string before the last token; ``stop_string`` names it); ``load_weights()`` (engines
that do not share the policy's weights) makes the engine sample from changed weights. An engine
registered with ``continuous_batching`` (``generate_one``) answers requests sent at once, each by
the same rules, and a request's seed decides what it samples.
"""

from __future__ import annotations

import math
from typing import Any

from rlhf.plugin_kit.checks.target import Target, guarded

N = 3
MAX_NEW = 6
STOP = ("e", "a", " ", "o")  # frequent characters, so a random model hits them


def check(target: Target) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.core.protocols.rollout import Generation, SamplingParams, batches_continuously

    ref = target.tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(ref)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    engine = guarded(target, "creating the engine", lambda: target.obj(model, tokenizer, target.config(
        model=str(ref), tokenizer=str(ref), max_new_tokens=MAX_NEW)))
    prompts = [tokenizer("What is 2 + 3?")["input_ids"], tokenizer("Say hello")["input_ids"]]
    eos = tokenizer.eos_token_id

    def generate(params: SamplingParams, what: str) -> list[Any]:
        out = guarded(target, f"generate ({what})", lambda: engine.generate(prompts, n=N, params=params))
        if not isinstance(out, list) or len(out) != len(prompts) * N:
            size = len(out) if isinstance(out, list) else type(out).__name__
            raise target.fail(f"generate(2 prompts, n={N}) should return a list of {2 * N} Generation, got {size} "
                              f"({what})")
        return valid(out, params, what)

    def valid(out: list[Any], params: SamplingParams, what: str) -> list[Any]:
        for i, g in enumerate(out):
            if not isinstance(g, Generation):
                raise target.fail(f"item {i} is {type(g).__name__}, not rlhf.core.protocols.rollout.Generation ({what})")
            if not all(isinstance(t, int) for t in g.token_ids) or not 0 < len(g.token_ids) <= params.max_new_tokens:
                raise target.fail(f"completion {i} has {len(g.token_ids)} tokens; expected 1 to "
                                  f"max_new_tokens={params.max_new_tokens} ints ({what})")
            if g.finish_reason not in ("stop", "length"):
                raise target.fail(f"completion {i} has finish_reason {g.finish_reason!r}; use 'stop' or 'length'")
            if eos in g.token_ids[:-1]:
                raise target.fail(f"completion {i} continues after EOS: {g.token_ids} ({what})")
            if g.token_ids[-1] == eos and g.finish_reason != "stop":
                raise target.fail(f"completion {i} ends with EOS but finish_reason is {g.finish_reason!r}")
        return out

    lines = []
    torch.manual_seed(0)
    out = generate(SamplingParams(max_new_tokens=MAX_NEW, return_logprobs=True), "with log-probs")
    for i, g in enumerate(out):
        if g.logprobs is None or len(g.logprobs) != len(g.token_ids):
            raise target.fail(f"return_logprobs=True: completion {i} has "
                              f"{'no' if g.logprobs is None else len(g.logprobs)} log-probs for {len(g.token_ids)} "
                              "tokens; give one per generated token")
        bad = [lp for lp in g.logprobs if not (isinstance(lp, (int, float)) and math.isfinite(lp) and lp <= 1e-6)]
        if bad:
            raise target.fail(f"completion {i} has log-probs {bad[:3]}; they must be finite and <= 0")
    lines.append(f"{len(out)} completions for 2 prompts x n={N}, each within max_new_tokens={MAX_NEW}, "
                 "one finite log-prob <= 0 per token")

    out = generate(SamplingParams(max_new_tokens=MAX_NEW, stop=STOP), "with stop strings")
    hits = 0
    for i, g in enumerate(out):
        before_last = tokenizer.decode(g.token_ids[:-1], skip_special_tokens=True)
        early = [s for s in STOP if s in before_last]
        if early:
            raise target.fail(f"completion {i} ({tokenizer.decode(g.token_ids)!r}) goes on after the stop string "
                              f"{early[0]!r}; stop at the first stop string")
        text = tokenizer.decode(g.token_ids, skip_special_tokens=True)
        if any(s in text for s in STOP):
            hits += 1
            if g.finish_reason != "stop":
                raise target.fail(f"completion {i} ended at a stop string with finish_reason {g.finish_reason!r}")
    lines.append(f"stop strings end completions at the first one ({hits}/{len(out)} hit one)")

    if batches_continuously(engine, SamplingParams(max_new_tokens=MAX_NEW),
                            declared=target.capabilities.get("continuous_batching", False)):
        lines.append(continuous_requests(target, engine, prompts, valid))

    if not engine.shares_weights:  # a protocol member, checked with the registration
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        guarded(target, "load_weights()", engine.load_weights)
        lines.append("load_weights() takes the policy's new weights")
    return lines



def continuous_requests(target: Target, engine: Any, prompts: list[list[int]], valid: Any) -> str:
    """``generate_one``: requests sent at once (with stop strings, log-probs, seeds), each a valid
    completion; the same seed twice gives the same tokens, other seeds other ones."""
    import asyncio

    from rlhf.core.protocols.rollout import SamplingParams

    def params(seed: int, **more: Any) -> SamplingParams:
        return SamplingParams(max_new_tokens=MAX_NEW, return_logprobs=True, seed=seed, **more)

    requests = [(prompts[i % 2], params(seed)) for i, seed in enumerate((11, 12, 11, 13))]
    requests += [(prompts[0], params(14, stop=STOP))]

    async def send() -> list[Any]:
        return list(await asyncio.gather(*(engine.generate_one(prompt, p) for prompt, p in requests)))

    out = guarded(target, "generate_one (requests at once)", lambda: asyncio.run(send()))
    for (_, p), g in zip(requests, out):
        valid([g], p, "generate_one")
        if g.logprobs is None or len(g.logprobs) != len(g.token_ids):
            raise target.fail("generate_one with return_logprobs=True must give one log-prob per token")
    if out[0].token_ids != out[2].token_ids:
        raise target.fail(f"generate_one: the same prompt with the same seed gave {out[0].token_ids} and "
                          f"{out[2].token_ids}; sample each request from a stream seeded with params.seed")
    return f"generate_one: {len(requests)} requests at once, each a valid completion; a seed repeats its sample"
