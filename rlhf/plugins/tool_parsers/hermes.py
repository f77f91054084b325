"""The Hermes tool-call format (Hermes 2 Pro, Qwen 2.5 and 3): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text
outside the blocks is the message's content.

A call's ``arguments`` are the model's own JSON text of the value, as it wrote it (never
re-serialised), so a streamed answer can send them as they are generated and end with exactly the
non-streamed answer's text; a string value (``"arguments": "{\\"x\\": 1}"``) is given decoded; a
call without arguments has ``{}``. ``"parameters"`` is read where ``"arguments"`` is missing.

A block whose JSON does not parse, that lacks a name, that has a key among ``name``,
``arguments`` and ``parameters`` twice (or both of the last two), or that is never closed makes
the whole completion unreadable: the raw text comes back as content with the reason (never an
exception).

`stream_calls` reads the calls of a completion still being generated (the optional streaming
method of rlhf.core.protocols.tool_parser): a call's name once its string is complete, its
arguments as their text grows.
"""

from __future__ import annotations

import json
import re

from rlhf.api import ParsedTurn, tool_call
from rlhf.plugins.tool_parsers.json_prefix import ObjectSoFar, read_object, string_prefix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
ARGUMENT_KEYS = ("arguments", "parameters")


def parse(text: str) -> ParsedTurn:
    if OPEN not in text:
        return ParsedTurn(content=text)
    calls, outside, last = [], [], 0
    for index, match in enumerate(_BLOCK.finditer(text)):
        outside.append(text[last:match.start()])
        last = match.end()
        call = _read_call(index, match.group(1).strip())
        if isinstance(call, str):
            return ParsedTurn(content=text, error=call)
        calls.append(call)
    rest = text[last:]
    if OPEN in rest:
        return ParsedTurn(content=text, error="a <tool_call> block is never closed")
    outside.append(rest)
    content = "".join(outside).strip()
    return ParsedTurn(content=content or None, tool_calls=calls)


def _read_call(index: int, body: str) -> dict | str:
    """A block's call, or what makes it unreadable."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"tool call {index} is not JSON: {exc.msg} in {body[:80]!r}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return f"tool call {index} has no \"name\": {body[:80]!r}"
    read = read_object(body)
    keys = [member.key for member in read.members]
    for key in ("name", *ARGUMENT_KEYS):
        if keys.count(key) > 1:
            return f"tool call {index} has \"{key}\" twice: {body[:80]!r}"
    if all(key in keys for key in ARGUMENT_KEYS):
        return f"tool call {index} has both \"arguments\" and \"parameters\": {body[:80]!r}"
    arguments, _ = _arguments(body, read)
    return tool_call(index, call["name"], arguments)


def _arguments(body: str, read: ObjectSoFar) -> tuple[str, int]:
    """The call's arguments as far as ``body`` fixes them, and the index in ``body`` that far."""
    member = next((m for m in read.members if m.key in ARGUMENT_KEYS), None)
    if member is None:
        return ("{}", read.closed) if read.closed is not None else ("", 0)
    if body[member.start] == '"':
        return string_prefix(body, member.start, member.end)
    end = len(body) if member.end is None else member.end
    return body[member.start:end], end


def stream_calls(text: str) -> list[dict]:
    """The calls begun in ``text`` (a completion so far), as far as it fixes them: each call's
    ``id``, its ``name`` once complete (else None), the prefix of its ``arguments`` text that it
    fixes, and ``end``, the index in ``text`` up to which the call is read."""
    calls: list[dict] = []
    at = 0
    while (start := text.find(OPEN, at)) >= 0:
        body_at = start + len(OPEN)
        close = text.find(CLOSE, body_at)
        body = text[body_at:close] if close >= 0 else _before_partial_close(text[body_at:])
        read = read_object(body)
        name, end = None, 0
        named = next((m for m in read.members if m.key == "name"), None)
        if named is not None and named.end is not None and body[named.start] == '"':
            value, read_to = string_prefix(body, named.start, named.end)
            if read_to == named.end:  # the whole name, decoded
                name, end = value, named.end
        arguments, read_to = _arguments(body, read)
        calls.append({"id": tool_call(len(calls), name or "", "")["id"], "name": name, "arguments": arguments,
                      "end": close + len(CLOSE) if close >= 0 else body_at + max(end, read_to)})
        if close < 0:
            break
        at = close + len(CLOSE)
    return calls


def _before_partial_close(body: str) -> str:
    """An unclosed block's text less a tail that may still grow into ``</tool_call>``."""
    for length in range(min(len(CLOSE) - 1, len(body)), 0, -1):
        if body.endswith(CLOSE[:length]):
            return body[:-length]
    return body


parse.stream_start = OPEN  # streamed answers send content up to a tool call (rlhf.core.protocols.tool_parser)
parse.stream_calls = stream_calls  # and the calls as they are generated
