"""Streamed answers of the agent endpoint (docs/agents.md, "The endpoint"): a completion cut into
chunks as its tokens arrive, none of which takes back what an earlier one sent.

- `TextStream`: the visible text, in content deltas; what may still change is held back (a tail
  that may become a stop string or the end-of-turn marker, an unfinished UTF-8 character, and with
  tools everything from the parser's ``stream_start`` on, and whitespace before it).
- `ToolStream`: the tool calls, as a parser's optional ``stream_calls`` reads them from the text
  so far (rlhf.core.protocols.tool_parser): a first delta with the call's ``index``, ``id``,
  ``type`` and ``name`` (``arguments`` ""), then the arguments' text as it grows; when the answer
  ends, what completes them into the parsed calls.
- `AnswerStream`: both, and which tokens each chunk releases: a chunk carries the log-probs of the
  tokens whose text it completes (``TextStream.ends``: where each token's text ends), in token
  order; tokens that show no text (the end-of-turn marker, a stop string) go with the last chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class StreamBroken(Exception):
    """A parser's ``stream_calls`` reported what its ``parse`` (or a longer text) contradicts."""


@dataclass(frozen=True)
class Chunk:
    """One chunk's delta and the tokens whose log-probs it carries (indices of the completion's tokens)."""

    delta: dict[str, Any]
    tokens: range


class TextStream:
    """The visible text of a completion as its tokens arrive, in deltas that never take back what
    they sent: the tail that may still become a stop string or the end-of-turn marker, an unfinished
    UTF-8 character, and (with tools) everything from the parser's ``stream_start`` on and trailing
    whitespace are held back until the answer ends (`AnswerStream.finish` sends what remains).
    ``streams`` False: no deltas at all (a parser without ``stream_start``)."""

    def __init__(self, template: Any, *, holdback: tuple[str, ...], tool_start: str | None, streams: bool):
        self.template, self.holdback, self.tool_start, self.streams = template, holdback, tool_start, streams
        self.tokens: list[int] = []
        self.ends: list[int] = []  # where each token's text ends (`rlhf.runtime.agents.logprobs.token_ends`)
        self.settled = ""  # the text no hold-back can change any more (tool calls are read from it)
        self.sent = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.template.decode(self.tokens, special=False)
        self.ends.append(max(self.ends[-1] if self.ends else 0, len(text)))
        self.settled = before(text, self.holdback).rstrip("\ufffd")
        if not self.streams:
            return ""
        safe_text = before(self.settled, (self.tool_start,)).rstrip() if self.tool_start else self.settled
        if not safe_text.startswith(self.sent) or len(safe_text) <= len(self.sent):
            return ""
        delta, self.sent = safe_text[len(self.sent):], safe_text
        return delta


def before(text: str, marks: tuple[str, ...]) -> str:
    """``text`` up to the first of ``marks`` in it, less a tail that may still grow into one."""
    safe = len(text)
    for mark in marks:
        found = text.find(mark)
        if found >= 0:
            safe = min(safe, found)
    for mark in marks:
        for length in range(min(len(mark) - 1, safe), 0, -1):
            if text[:safe].endswith(mark[:length]):
                safe -= length
                break
    return text[:safe]


class ToolStream:
    """Tool-call deltas in OpenAI's streamed shape from a parser's ``stream_calls(text)``: per call a
    header (``index``, ``id``, ``type``, ``function.name``, ``arguments`` "") once its name is
    complete, then ``function.arguments`` fragments as they grow. ``end``: the text the deltas sent
    account for."""

    def __init__(self, stream_calls: Any = None):
        self.stream_calls = stream_calls
        self.sent: list[list[str]] = []  # [id, name, arguments sent] of each call whose header went out
        self.end = 0

    def update(self, text: str) -> list[dict[str, Any]]:
        """The deltas of what ``text`` adds to the calls sent (one ``tool_calls`` entry each)."""
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(self.stream_calls(text) if self.stream_calls else []):
            if call["name"] is None:
                break
            deltas += self._extend(index, call["id"], call["name"], call["arguments"])
            self.end = max(self.end, call["end"])
        return deltas

    def finish(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The deltas that complete the calls sent into ``calls``, the answer's parsed tool calls."""
        if len(calls) < len(self.sent):
            raise StreamBroken(f"{len(self.sent)} tool calls were streamed, the answer has {len(calls)}")
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            deltas += self._extend(index, call["id"], call["function"]["name"], call["function"]["arguments"])
        return deltas

    def _extend(self, index: int, ident: str, name: str, arguments: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if index == len(self.sent):
            deltas.append({"index": index, "id": ident, "type": "function",
                           "function": {"name": name, "arguments": ""}})
            self.sent.append([ident, name, ""])
        sent_id, sent_name, sent = self.sent[index]
        if (sent_id, sent_name) != (ident, name) or not arguments.startswith(sent):
            raise StreamBroken(f"tool call {index} was streamed as {sent_id} {sent_name}({sent}...), then read as "
                               f"{ident} {name}({arguments}): the tool parser's stream_calls and parse disagree "
                               "(`rlhf plugins check` shows it)")
        if len(arguments) > len(sent):
            deltas.append({"index": index, "function": {"arguments": arguments[len(sent):]}})
            self.sent[index][2] = arguments
        return deltas


class AnswerStream:
    """A streamed answer's chunks: content and (with a parser) tool-call deltas as tokens arrive
    (`add`), then what completes them into the answer (`finish`); each chunk names the tokens whose
    log-probs it carries. ``parser`` None: no tools are read (``/v1/completions``, ``tool_choice``
    "none", no tools); a parser without ``stream_start`` has its content sent when the answer ends,
    one without ``stream_calls`` (or ``stream_start``) its tool calls."""

    def __init__(self, template: Any, *, holdback: tuple[str, ...], parser: Any = None):
        tool_start = getattr(parser, "stream_start", None) if parser is not None else None
        self.text = TextStream(template, holdback=holdback, tool_start=tool_start,
                               streams=parser is None or tool_start is not None)
        self.tools = ToolStream(getattr(parser, "stream_calls", None) if tool_start else None)
        self.released = 0  # tokens whose log-probs went out

    def add(self, token: int) -> list[Chunk]:
        chunks = []
        delta = self.text.add(token)
        if delta:
            chunks.append(Chunk({"content": delta}, self._release(len(self.text.sent))))
        tool_deltas = self.tools.update(self.text.settled)
        for index, tool_delta in enumerate(tool_deltas):
            last = index == len(tool_deltas) - 1
            chunks.append(Chunk({"tool_calls": [tool_delta]},
                                self._release(self.tools.end) if last else range(self.released, self.released)))
        return chunks

    def finish(self, ids: list[int], content: str | None, calls: list[dict[str, Any]] | None,
               visible: int) -> list[Chunk]:
        """The chunks that complete the answer: the tokens the engine did not report as it went
        (``ids`` are all of them), the rest of the tool calls (``calls``: the parsed ones; None when
        the parser could not read the answer: what was streamed of them stays), then the rest of
        ``content``, which releases the tokens up to ``visible``, the length of the answer's text."""
        chunks = [chunk for token in ids[len(self.text.tokens):] for chunk in self.add(token)]
        if calls is not None:
            chunks += [Chunk({"tool_calls": [delta]}, range(self.released, self.released))
                       for delta in self.tools.finish(calls)]
        content = content or ""
        rest = content[len(self.text.sent):] if content.startswith(self.text.sent) else ""
        if rest:
            chunks.append(Chunk({"content": rest}, self._release(visible, limit=len(ids))))
        return chunks

    def rest(self, count: int) -> range:
        """The tokens of ``count`` whose log-probs have not gone out (the last chunk carries them)."""
        start, self.released = self.released, max(self.released, count)
        return range(start, self.released)

    def _release(self, offset: int, limit: int | None = None) -> range:
        """The tokens whose text ends by ``offset`` and have not gone out yet."""
        start, ends = self.released, self.text.ends[:limit]
        while self.released < len(ends) and ends[self.released] <= offset:
            self.released += 1
        return range(start, self.released)
