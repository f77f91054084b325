"""The built-in Hermes tool-call parser: calls out, content between them, unreadable completions
come back as raw text with the reason (never an exception); registered as ``--tool-parser hermes``."""

from __future__ import annotations

import json

import pytest

from rlhf.api import ParsedTurn
from rlhf.plugins.tool_parsers.hermes import parse

pytestmark = pytest.mark.unit


def test_calls_and_the_content_around_them():
    text = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {"a": 3}}</tool_call> done')
    turn = parse(text)
    assert turn.error is None
    assert turn.content == "Let me add.  done"
    assert [c["function"]["name"] for c in turn.tool_calls] == ["add", "mul"]
    assert json.loads(turn.tool_calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert [c["id"] for c in turn.tool_calls] == ["call_0", "call_1"]
    assert all(c["type"] == "function" for c in turn.tool_calls)


def test_plain_text_and_only_calls():
    assert parse("just words") == ParsedTurn(content="just words")
    only = parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert only.content is None and only.tool_calls[0]["function"]["arguments"] == '{"x": 1}'


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": "f", "arguments": {</tool_call>', "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no \"name\""),
    ('<tool_call>["f"]</tool_call>', "no \"name\""),
    ('ok <tool_call>{"name": "f"}', "never closed"),
])
def test_an_unreadable_completion_is_raw_text_and_a_reason(text, reason):
    turn = parse(text)
    assert turn.content == text and turn.tool_calls == []
    assert reason in turn.error


def test_registered_as_a_tool_parser(plugins):
    component = plugins.registry("tool_parser").component("hermes")
    assert component.load() is parse
