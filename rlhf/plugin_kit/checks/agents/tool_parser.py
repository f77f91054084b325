"""Contract of a tool-call parser (``register_tool_parsers``): ``parse(text)`` returns a
``ParsedTurn`` for any text, never raising (plain text, tool-call markers, broken JSON, unclosed
blocks, random bytes); its tool calls have OpenAI's shape (``id``, ``type`` "function", a function
``name`` and JSON ``arguments`` text); a turn with an ``error`` gives the raw text back as content and
no calls; it is deterministic. A parser with the optional ``stream_calls`` (streamed tool calls)
also has ``stream_start``, and on every prefix of every text its calls only grow (a call's ``id``
and ``name``, once given, stay; its ``arguments`` are a prefix of what a longer text gives; ``end``
lies within the text), ending as ``parse`` reads the whole text when it reads it."""

from __future__ import annotations

import json
import random
from typing import Any

from rlhf.plugin_kit.checks.target import Target

TEXTS = [
    "", "The answer is 5.", "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1}}</tool_call>",
    "<tool_call>{broken",
    "I add.<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":1,\"b\":\"x\"}}</tool_call>\n"
    "<tool_call>{\"name\": \"mul\", \"arguments\": {}}</tool_call>",
    "[TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {}}]", "[TOOL_CALLS] not json",
    "```python\nprint(1)\n```", "<tool_call></tool_call>", "{\"name\": \"add\"}",
]


def _texts() -> list[str]:
    rng = random.Random(0)
    alphabet = "<>/{}[]\":,_ abcxyz TOOL_CALLStool_call\n"
    return TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(40)]


def check(target: Target) -> list[str]:
    from rlhf.core.protocols.tool_parser import ParsedTurn

    calls = failures = 0
    for text in _texts():
        try:
            turn = target.obj(text)
        except Exception as exc:
            raise target.fail(f"raised {type(exc).__name__}: {exc} on {text!r}; a completion it cannot read is "
                              "ParsedTurn(content=text, error=...), never an exception") from exc
        if not isinstance(turn, ParsedTurn):
            raise target.fail(f"returned {type(turn).__name__} for {text!r}, not rlhf.api.ParsedTurn")
        if turn.content is not None and not isinstance(turn.content, str):
            raise target.fail(f"content must be a string or None, got {type(turn.content).__name__} for {text!r}")
        if turn.error is not None:
            failures += 1
            if turn.content != text or turn.tool_calls:
                raise target.fail(f"a turn with an error must give the raw text back as content and no tool calls "
                                  f"({text!r})")
        for call in turn.tool_calls:
            _check_call(target, call, text)
            calls += 1
        if target.obj(text) != turn:
            raise target.fail(f"gave another answer for the same text {text!r}: a parser must be deterministic")
    return [f"never raised on {len(_texts())} texts (plain, marked, broken, random)",
            f"{calls} tool calls in OpenAI's shape, {failures} unreadable texts given back as content with a reason",
            "deterministic", *_check_stream(target)]


def _check_stream(target: Target) -> list[str]:
    stream_calls = getattr(target.obj, "stream_calls", None)
    if stream_calls is None:
        return []
    if not getattr(target.obj, "stream_start", None):
        raise target.fail("has stream_calls but no stream_start: the endpoint streams tool calls only from a parser "
                          "that says where they start")
    streamed = 0
    for text in _texts():
        before: list[dict] = []
        for length in range(len(text) + 1):
            try:
                calls = stream_calls(text[:length])
            except Exception as exc:
                raise target.fail(f"stream_calls raised {type(exc).__name__}: {exc} on {text[:length]!r}") from exc
            _check_growth(target, before, calls, text[:length])
            before = calls
        turn = target.obj(text)
        if turn.error is None and turn.tool_calls:
            final = [{"id": c["id"], "name": c["name"], "arguments": c["arguments"]} for c in before]
            wanted = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in turn.tool_calls]
            if final != wanted:
                raise target.fail(f"stream_calls ends with {final} but parse reads {wanted} from {text!r}: a streamed "
                                  "answer must end as the non-streamed one")
            streamed += len(final)
    return [f"streams tool calls: {streamed} calls grown character by character end as parse reads them"]


def _check_growth(target: Target, before: list[dict], calls: Any, text: str) -> None:
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) and
                                              (c.get("name") is None or isinstance(c.get("name"), str)) and
                                              isinstance(c.get("arguments"), str) and isinstance(c.get("end"), int)
                                              for c in calls):
        raise target.fail(f"stream_calls must return a list of {{\"id\", \"name\", \"arguments\", \"end\"}} dicts, "
                          f"got {calls!r} for {text!r}")
    if len(calls) < len(before):
        raise target.fail(f"stream_calls dropped a call as the text grew to {text!r}")
    for old, new in zip(before, calls):
        if new["id"] != old["id"] or (old["name"] is not None and new["name"] != old["name"]) or \
                not new["arguments"].startswith(old["arguments"]) or not old["end"] <= new["end"] <= len(text):
            raise target.fail(f"stream_calls took back what it gave: {old} became {new} as the text grew to {text!r}; "
                              "a streamed delta cannot be taken back")


def _check_call(target: Target, call: Any, text: str) -> None:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type") != "function" or not isinstance(call.get("id"), str) or \
            not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise target.fail(f"a tool call must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          f"\"arguments\"}}}} (rlhf.api.tool_call builds one), got {call!r} for {text!r}")
    arguments = function.get("arguments")
    try:
        json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        raise target.fail(f"a tool call's arguments must be JSON text, as OpenAI sends them, got {arguments!r} "
                          f"for {text!r}") from None
