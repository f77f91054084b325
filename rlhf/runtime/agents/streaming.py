"""Streamed answers of the agent endpoint: the visible text of a completion as its tokens arrive,
cut into deltas that never take back what they sent (docs/agents.md, "The endpoint")."""

from __future__ import annotations

from typing import Any


class TextStream:
    """The visible text of a completion as its tokens arrive, in deltas that never take back what
    they sent: the tail that may still become a stop string or the end-of-turn marker, an unfinished
    UTF-8 character, and (with tools) everything from the parser's ``stream_start`` on and trailing
    whitespace are held back until the answer ends (`AgentEndpoint._stream` sends what remains)."""

    def __init__(self, template: Any, *, holdback: tuple[str, ...], tool_start: str | None, streams: bool):
        self.template, self.holdback, self.tool_start, self.streams = template, holdback, tool_start, streams
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        if not self.streams:
            return ""
        text = self.template.decode(self.tokens, special=False)
        safe = len(text)
        for cut in self.holdback:
            found = text.find(cut)
            if found >= 0:
                safe = min(safe, found)
        if self.tool_start:
            found = text.find(self.tool_start)
            safe = min(safe, found if found >= 0 else safe)
        for mark in (*self.holdback, *((self.tool_start,) if self.tool_start else ())):
            for k in range(min(len(mark) - 1, safe), 0, -1):  # a tail that may grow into the mark
                if text[:safe].endswith(mark[:k]):
                    safe -= k
                    break
        safe_text = text[:safe].rstrip("\ufffd")
        if self.tool_start:
            safe_text = safe_text.rstrip()
        if not safe_text.startswith(self.sent) or len(safe_text) <= len(self.sent):
            return ""
        delta, self.sent = safe_text[len(self.sent):], safe_text
        return delta
