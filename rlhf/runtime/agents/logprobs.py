"""The log-probs of a completion's tokens in OpenAI's shapes, for whole answers and for each chunk
of a streamed one (the same functions, so the chunks' log-probs joined are the whole answer's):

- chat (``logprobs: true``, ``top_logprobs`` k): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [...]}]}``, one entry per token;
- completions (``logprobs`` k, the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, ``text_offset`` the character offset where each token's text starts in the
  choice's text (`token_ends`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sampled:
    """One sampled token: its id, log-prob and the engine's k most likely tokens of the distribution it
    was sampled from (``(id, logprob)`` pairs; None where the engine does not offer them)."""

    token: int
    logprob: float
    alternatives: list | None = None


def sampled_of(generation: Any, top: int) -> list[Sampled]:
    """A generation's tokens with their log-probs (and ``top`` alternatives, where the engine gave them)."""
    ids = list(generation.token_ids)
    logprobs = generation.logprobs or [0.0] * len(ids)
    alternatives = generation.extra.get("top_logprobs") if top else None
    return [Sampled(token, logprob, alternatives[index] if alternatives is not None and index < len(alternatives)
                    else None) for index, (token, logprob) in enumerate(zip(ids, logprobs))]


def chat_logprobs(template: Any, sampled: list[Sampled], top: int) -> dict[str, Any]:
    """OpenAI's ``logprobs.content``: each token's log-prob and, with ``top_logprobs`` k, the k most
    likely tokens of the distribution it was sampled from (the engine's, where it offers them; else
    the sampled token alone)."""
    content = []
    for one in sampled:
        entry = _entry(template, one.token, one.logprob)
        if not top:
            tops = []
        elif one.alternatives is not None:
            tops = [_entry(template, i, lp) for i, lp in one.alternatives[:top]]
        else:
            tops = [dict(entry)]
        content.append({**entry, "top_logprobs": tops})
    return {"content": content}


def legacy_logprobs(template: Any, sampled: list[Sampled], top: int, offsets: list[int]) -> dict[str, Any]:
    """``/v1/completions``' shape: tokens, their log-probs, the ``top`` alternatives (where the engine
    offers them) and each token's ``text_offset``."""
    shaped = {"tokens": [template.decode([one.token]) for one in sampled],
              "token_logprobs": [one.logprob for one in sampled]}
    if top and all(one.alternatives is not None for one in sampled):
        shaped["top_logprobs"] = [{template.decode([i]): lp for i, lp in one.alternatives[:top]} for one in sampled]
    shaped["text_offset"] = list(offsets)
    return shaped


def token_ends(template: Any, ids: list[int]) -> list[int]:
    """Where each token's text ends in the completion's text (special tokens left out): the length of
    the text of the tokens up to it, never less than the one before (`TextStream` counts alike)."""
    ends: list[int] = []
    for count in range(1, len(ids) + 1):
        ends.append(max(ends[-1] if ends else 0, len(template.decode(ids[:count], special=False))))
    return ends


def text_offsets(ends: list[int], start: int, stop: int, length: int) -> list[int]:
    """The ``text_offset`` of tokens ``start`` to ``stop``: where each one's text starts (the end of the
    one before), at most ``length``, the choice's text."""
    return [min(ends[index - 1] if index else 0, length) for index in range(start, stop)]


def _entry(template: Any, token: int, logprob: float) -> dict[str, Any]:
    text = template.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
