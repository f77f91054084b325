"""The tool-call parser contract (``--tool-parser NAME``): a completion's text -> the OpenAI message
parts the agent endpoint answers with.

    parse(text: str) -> ParsedTurn

``text`` is the decoded completion (special tokens kept, so markers like ``<tool_call>`` survive);
the parser returns its ``content`` (the text outside the tool calls, None when there is none) and
its ``tool_calls`` in OpenAI's shape (``{"id", "type": "function", "function": {"name",
"arguments": <JSON text>}}``). A completion it cannot read is not an exception: it returns the raw
text as ``content``, no tool calls, and an ``error`` line saying what it could not read (the
endpoint records it as a parse failure).

Optional, for streamed answers (``stream: true``; attributes of ``parse``, or methods of a parser
object):

- ``stream_start``: the text that starts a tool call (Hermes: ``<tool_call>``). A streamed answer
  to a request with tools sends its content as it is generated up to that text; a parser without
  it has the content and the tool calls sent when the answer ends.
- ``stream_calls(text) -> list[dict]`` (used with ``stream_start``): the tool calls begun in
  ``text``, the completion so far, each as ``{"id", "name", "arguments", "end"}``: its id (as
  ``parse`` will give it), its name once complete (None before), the prefix of its ``arguments``
  text that ``text`` already fixes, and ``end``, how far into ``text`` the call is read. The
  endpoint streams a call's first delta (``index``, ``id``, ``type``, ``function.name``) once its
  name is there, then its ``arguments`` as they grow, as OpenAI does. Its promise: as ``text``
  grows, a call's id and name, once given, stay and its arguments only grow; for a text ``parse``
  reads, its calls end exactly as ``parse`` gives them (a parser that re-serialises arguments in
  ``parse`` must stream the same serialisation). ``rlhf plugins check`` tests this on every prefix
  of its texts. A parser without it has each tool call sent whole when the answer ends.

A streamed delta is never taken back: when ``parse`` cannot read the finished completion after a
call's deltas went out, the stream ends as the non-streamed answer does (the raw text as content,
``finish_reason`` "stop" or "length", a recorded parse failure); only ``finish_reason``
"tool_calls" confirms the streamed calls (docs/agents.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedTurn:
    """One completion as OpenAI message parts."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # what could not be read (then content is the raw text)


def tool_call(index: int, name: str, arguments: str, prefix: str = "call") -> dict[str, Any]:
    """A tool call in OpenAI's shape; ``arguments`` is JSON text, as OpenAI sends it."""
    return {"id": f"{prefix}_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}
