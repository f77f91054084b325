"""The top level of a JSON object read from text that may still be growing (a tool call being
generated): its members as far as the text holds them, each value's span in the text, and whether
the object is closed. It does not validate (``json.loads`` of the whole does that once it ends); it
stops at the first character that cannot continue an object, so what it reports of a text is never
contradicted by the same text grown longer.

A string value's decoded prefix (`string_prefix`) counts only whole characters and escapes (a high
surrogate waits for its low half), so it only ever grows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SPACE = " \t\n\r"  # JSON's whitespace
PRIMITIVE = frozenset("0123456789+-.eEtruefalsn")  # the characters of numbers, true, false and null
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')


@dataclass(frozen=True)
class Member:
    """One member of the object: its key, where its value starts and ends (None: not yet)."""

    key: str
    start: int
    end: int | None


@dataclass(frozen=True)
class ObjectSoFar:
    members: tuple[Member, ...]
    closed: int | None  # the index after the object's closing brace; None while it is open


def read_object(text: str) -> ObjectSoFar:
    """The members of the object ``text`` starts with (after whitespace), as far as ``text`` holds them."""
    members: list[Member] = []
    at = _skip(text, 0)
    if at >= len(text) or text[at] != "{":
        return ObjectSoFar((), None)
    at += 1
    while True:
        at = _skip(text, at)
        if at >= len(text):
            break
        if text[at] == "}":
            return ObjectSoFar(tuple(members), at + 1)
        if members:
            if text[at] != ",":
                break
            at = _skip(text, at + 1)
        key_end = string_end(text, at) if at < len(text) and text[at] == '"' else None
        if key_end is None:
            break
        try:
            key = json.loads(text[at:key_end])
        except ValueError:
            break
        at = _skip(text, key_end)
        if at >= len(text) or text[at] != ":":
            break
        at = _skip(text, at + 1)
        if at >= len(text):
            break
        end = value_end(text, at)
        if end == -1:
            break
        members.append(Member(key, at, end))
        if end is None:
            break
        at = end
    return ObjectSoFar(tuple(members), None)


def string_end(text: str, at: int) -> int | None:
    """The index after the string that opens at ``text[at]`` (a quote); None while it is unclosed."""
    index = at + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            return index + 1
        index += 1
    return None


def value_end(text: str, at: int) -> int | None:
    """The index after the value that starts at ``text[at]``; None while it may still grow; -1 when
    no value starts there."""
    char = text[at]
    if char == '"':
        return string_end(text, at)
    if char in "{[":
        depth, index = 0, at
        while index < len(text):
            char = text[index]
            if char == '"':
                end = string_end(text, index)
                if end is None:
                    return None
                index = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        return None
    if char in PRIMITIVE:
        index = at
        while index < len(text) and text[index] in PRIMITIVE:
            index += 1
        return None if index == len(text) else index
    return -1


def string_prefix(text: str, at: int, end: int | None) -> tuple[str, int]:
    """The string value at ``text[at]`` (a quote) decoded as far as it is certain, and the index in
    ``text`` that far: the whole string when it is closed (``end``), else its whole characters and
    escapes (a high surrogate escape waits for the escape after it)."""
    if end is not None:
        try:
            return json.loads(text[at:end]), end
        except ValueError:  # an invalid escape: decoded up to it, as while it was open
            pass
    index = safe = at + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            step = _escape_length(text, index)
            if step is None:
                break
            index += step
        elif char == '"' or ord(char) < 0x20:  # its end (an invalid escape before it), or not JSON
            break
        else:
            index += 1
        safe = index
    return json.loads('"' + text[at + 1:safe] + '"'), safe


def _escape_length(text: str, at: int) -> int | None:
    """How many characters the escape at ``text[at]`` takes; None while incomplete or invalid."""
    if at + 1 >= len(text):
        return None
    kind = text[at + 1]
    if kind in _ESCAPES:
        return 2
    if kind != "u" or at + 6 > len(text) or not set(text[at + 2:at + 6]) <= _HEX:
        return None
    if 0xD800 <= int(text[at + 2:at + 6], 16) < 0xDC00:  # a high surrogate decodes together with what follows
        after = _escape_length(text, at + 6) if text[at + 6:at + 7] == "\\" else None
        return None if after is None else 6 + after
    return 6


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in SPACE:
        at += 1
    return at
