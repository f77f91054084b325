"""The tool-call parser contract (``--tool-parser NAME``): a completion's text -> the OpenAI message
parts the agent endpoint answers with.

    parse(text: str) -> ParsedTurn

``text`` is the decoded completion (special tokens kept, so markers like ``<tool_call>`` survive);
the parser returns its ``content`` (the text outside the tool calls, None when there is none) and
its ``tool_calls`` in OpenAI's shape (``{"id", "type": "function", "function": {"name",
"arguments": <JSON text>}}``). A completion it cannot read is not an exception: it returns the raw
text as ``content``, no tool calls, and an ``error`` line saying what it could not read (the
endpoint records it as a parse failure).

Optional: ``parse.stream_start``, the text that starts a tool call (Hermes: ``<tool_call>``). A
streamed answer to a request with tools sends its content as it is generated up to that text (and
the tool calls at the end); a parser without it has the content sent when the answer ends.
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
