"""The rollout-engine contract (``register_rollout_engines``): what an engine receives and returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """How to sample one turn: the logits z through the repetition penalty (each token the row
    holds, prompt included: z / p when z > 0, else z · p), then z / temperature, then the ``top_k``
    largest, then the top-p nucleus; greedy (argmax of the penalised logits) at temperature 0.

    Log-probs: an engine's (``return_logprobs``) are those of this sampling distribution. The
    trainer's are the policy's, ``log softmax(z / temperature)`` over the whole vocabulary, and the
    ratio and KL are computed from those; with top-k, top-p or a penalty the samples come from a
    distribution other than the one trained, which a policy loss's mismatch correction (``tis``,
    ``icepop``) weighs with the engine's log-probs.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    stop: tuple[str, ...] = ()  # stop strings (multi-turn environments); EOS always stops
    return_logprobs: bool = False  # report the log-prob of each sampled token
    # report them where that holds no more memory than sampling does (tokens.jsonl asks this; a
    # decoder that would keep a (B, V) copy per token to have them reports none); engines may ignore it
    logprobs_if_free: bool = False
    seed: int | None = None  # a random stream of the request's own (None: the engine's stream)
    # the version of the weights that sample (the steps they have taken; None: not told), which the
    # agent endpoint records with every sampled token (docs/agents.md); engines ignore it
    policy_version: int | None = None


@dataclass(kw_only=True)
class Generation:
    """One completion of one prompt."""

    token_ids: list[int]  # generated tokens, EOS included when generated, no padding
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    logprobs: list[float] | None = None  # per generated token, when asked for
    stop_string: str | None = None  # the stop string that ended generation, if any
    extra: dict = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    """The rollout-engine contract (``register_rollout_engines``).

    The runtime creates ``engine_cls(model, tokenizer, config)`` with the policy module, then calls
    ``generate`` for every turn of every rollout. ``shares_weights``: the engine samples from that
    module in place (nothing to sync). Otherwise the runtime calls ``load_weights()`` after each
    optimizer step (and after a resume): the engine takes the weights from the policy module it
    was built with (LoRA merged, sharded weights gathered: the engine's business).
    """

    shares_weights: bool

    def generate(self, prompts: list[list[int]], *, n: int, params: SamplingParams) -> list[Generation]:
        """``n`` completions per prompt (token-id lists), contiguous: ``[p0s0 .. p0s(n-1), p1s0, ...]``."""

    def load_weights(self, state: Mapping[str, Any] | None = None) -> None:
        """Sample from new weights from now on: the policy module's (``state`` None, what the runtime
        passes) or those of ``state`` (full weights under the policy's parameter names)."""


@runtime_checkable
class ContinuousEngine(Protocol):
    """What an engine registered with ``continuous_batching=True`` has besides `RolloutEngine`
    (checked with the registration): continuous batching, one request at a time.

    ``generate_one`` generates one completion of one prompt, batched with every other request in
    flight from the same event loop: a request joins the running decode batch at its next step
    and leaves it when it ends, so a multi-turn trajectory's next turn starts as soon as its tool
    call returns instead of waiting for the turn of the whole batch. ``params.seed`` (the rollout
    sets one per request) seeds the request's own random stream, so what it samples does not
    depend on which other requests share its batch (up to the float rounding of a batched
    forward). ``continuous_for(params)`` may decline some rollouts (say, a model its decoder does
    not support); those go through ``generate`` turn by turn.

    ``many_event_loops`` (optional, default False): ``generate_one`` may be awaited from several
    event loops, on several threads, at once, each loop's requests batched apart (the ``hf``
    engine: a decode batch per loop). Where an engine does not declare it, ``--partial-rollouts``
    awaits it from one loop of its own for every generation lane that shares it
    (`rlhf.runtime.rl.offpolicy.served`).
    """

    async def generate_one(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """One completion of ``prompt_ids``, sampled with ``params`` beside the other requests in flight.

        Two keyword arguments are optional (the agent endpoint passes them only to an engine whose
        ``generate_one`` names them; the ``hf`` and ``vllm`` engines do):

        - ``on_token(token_id, logprob, alternatives)``, called on the event loop's thread as each
          token is sampled, in order, before the call returns (streamed answers); it must not block.
          A stop string's tokens may have been reported before the completion is cut at it.
        - ``top_logprobs`` k (0 to 20): the k most likely tokens of the distribution each token was
          sampled from (the one its ``logprobs`` entry is of: after the repetition penalty,
          temperature, top-k and top-p; excluded tokens left out), most likely first, as
          ``Generation.extra["top_logprobs"]``: per token a list of ``(token_id, logprob)``, also the
          ``alternatives`` ``on_token`` gets.
        """

    def continuous_for(self, params: SamplingParams) -> bool:
        """Whether rollouts sampled with ``params`` go through `generate_one`."""


def batches_continuously(engine: Any, params: SamplingParams, *, declared: bool) -> bool:
    """Whether ``engine`` batches the requests of a rollout sampled with ``params`` continuously:
    its registration declares ``continuous_batching`` (``declared``: the engine's capability, so
    its class implements `ContinuousEngine`) and its ``continuous_for(params)`` takes the rollout."""
    return declared and bool(engine.continuous_for(params))
