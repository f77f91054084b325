"""The Hermes tool-call format (Hermes 2 Pro, Qwen 2.5 and 3): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text
outside the blocks is the message's content.

A block whose JSON does not parse, that lacks a name, or that is never closed makes the whole
completion unreadable: the raw text comes back as content with the reason (never an exception).
"""

from __future__ import annotations

import json
import re

from rlhf.api import ParsedTurn, tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def parse(text: str) -> ParsedTurn:
    if OPEN not in text:
        return ParsedTurn(content=text)
    calls, outside, last = [], [], 0
    for index, match in enumerate(_BLOCK.finditer(text)):
        outside.append(text[last:match.start()])
        last = match.end()
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return ParsedTurn(content=text, error=f"tool call {index} is not JSON: {exc.msg} in {body[:80]!r}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedTurn(content=text, error=f"tool call {index} has no \"name\": {body[:80]!r}")
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(tool_call(index, call["name"],
                               arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)))
    rest = text[last:]
    if OPEN in rest:
        return ParsedTurn(content=text, error="a <tool_call> block is never closed")
    outside.append(rest)
    content = "".join(outside).strip()
    return ParsedTurn(content=content or None, tool_calls=calls)


parse.stream_start = OPEN  # streamed answers send content up to a tool call (rlhf.core.protocols.tool_parser)
