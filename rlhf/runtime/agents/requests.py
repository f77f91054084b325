"""Reading OpenAI requests for the agent endpoint: what a request may ask, checked against the run.

Every problem is a `BadRequest` with a line saying why; the endpoint answers it as OpenAI does,
``{"error": {"message", "type", "code"}}`` with status 400 (401 for a wrong key).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlhf.runtime.agents.template import ROLES, content_text


class BadRequest(Exception):
    """A request the endpoint refuses: ``status``, OpenAI's error ``kind`` and ``code``."""

    def __init__(self, message: str, *, code: str = "invalid_request", status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.code, self.status, self.kind = message, code, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code, "param": None}}


@dataclass(frozen=True)
class RunSampling:
    """The run's sampling settings, which every request samples with."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    max_new_tokens: int  # a completion's budget
    max_total_tokens: int  # a sequence's budget (prompt and every turn)


_OVERRIDES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "repetition_penalty": "repetition_penalty"}
_ZERO_BY_DEFAULT = ("presence_penalty", "frequency_penalty", "min_p")


def check_sampling(body: dict[str, Any], run: RunSampling) -> None:
    """A request that asks for sampling other than the run's is refused: the trainer's log-probs
    assume the run's distribution."""
    for key, attr in _OVERRIDES.items():
        value = body.get(key)
        if value is None:
            continue
        mine = getattr(run, attr)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isclose(float(value), mine):
            raise BadRequest(f"{key}={value!r}: this endpoint samples with the run's {key} ({mine}); the trainer's "
                             f"log-probs assume it. Leave {key} out, or set the run's --{key.replace('_', '-')}",
                             code="unsupported_sampling")
    for key in _ZERO_BY_DEFAULT:
        if body.get(key) not in (None, 0, 0.0):
            raise BadRequest(f"{key}={body[key]!r}: this endpoint samples with the run's settings only; leave "
                             f"{key} out", code="unsupported_sampling")
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n={body['n']!r}: one completion per request (the run's --n-samples makes the group)",
                         code="unsupported_sampling")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias: this endpoint samples with the run's settings only", code="unsupported_sampling")


def budget(body: dict[str, Any], prompt_tokens: int, run: RunSampling) -> int:
    """``max_tokens`` / ``max_completion_tokens`` capped by the run's budgets; 400 when no room is left."""
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise BadRequest(f"max_tokens must be a positive integer, got {asked!r}")
    room = run.max_total_tokens - prompt_tokens
    if room < 1:
        raise BadRequest(f"the conversation holds {prompt_tokens} tokens and the run's budget per trajectory is "
                         f"{run.max_total_tokens} (--max-total-tokens): no room for another turn",
                         code="context_length_exceeded")
    return min(asked or run.max_new_tokens, run.max_new_tokens, room)


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(stops)


def check_messages(body: dict[str, Any]) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {\"role\", \"content\"} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{index}] must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{index}].role is {role!r}; this endpoint takes {', '.join(ROLES)}")
        try:
            content_text(message.get("content"))
        except ValueError as exc:
            raise BadRequest(f"messages[{index}]: {exc}") from None
    return messages


def check_tools(body: dict[str, Any]) -> tuple[list[dict] | None, bool]:
    """(tools, parse): the tools to render, and whether to read tool calls out of the completion."""
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise BadRequest(f"tool_choice={choice!r}: this endpoint supports \"auto\" and \"none\"",
                         code="unsupported_tool_choice")
    return tools, tools is not None and choice != "none"


def prompt_of(body: dict[str, Any], tokenize: Any) -> list[int]:
    """``/v1/completions``' prompt as token ids: text, token ids, or a list of one of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in prompt):
        return list(prompt)
    raise BadRequest("prompt must be one non-empty string or one list of token ids")


def top_logprobs(body: dict[str, Any]) -> int:
    """``top_logprobs`` (0 to 20, as OpenAI takes it; it needs ``logprobs``)."""
    top = body.get("top_logprobs")
    if top is None:
        return 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
        raise BadRequest(f"top_logprobs must be an integer from 0 to 20, got {top!r}")
    if top and not body.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true")
    return top


def legacy_top_logprobs(body: dict[str, Any]) -> int:
    """``/v1/completions``' ``logprobs``: true/0 the sampled token's, an integer k also the k most likely (up to 20)."""
    value = body.get("logprobs")
    if value is None or isinstance(value, bool):
        return 0
    if not isinstance(value, int) or not 0 <= value <= 20:
        raise BadRequest(f"logprobs must be true, false or an integer from 0 to 20, got {value!r}")
    return value
