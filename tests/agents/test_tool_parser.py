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


def test_arguments_are_the_models_own_json_text():
    compact = parse('<tool_call>{"name":"add","arguments":{"a":1,"b":[2, 3]}}</tool_call>')
    assert compact.tool_calls[0]["function"]["arguments"] == '{"a":1,"b":[2, 3]}'  # not re-serialised
    spaced = parse('<tool_call>\n{"name": "add", "arguments": {"x": "é\\n"} }\n</tool_call>')
    assert spaced.tool_calls[0]["function"]["arguments"] == '{"x": "é\\n"}'
    assert parse('<tool_call>{"name": "f"}</tool_call>').tool_calls[0]["function"]["arguments"] == "{}"
    assert parse('<tool_call>{"parameters": {"q": 1}, "name": "f"}</tool_call>').tool_calls[0]["function"] == {
        "name": "f", "arguments": '{"q": 1}'}
    assert parse('<tool_call>{"name": "f", "arguments": 12}</tool_call>').tool_calls[0]["function"]["arguments"] == "12"


@pytest.mark.parametrize("body, reason", [
    ('{"name": "f", "name": "g", "arguments": {}}', '"name" twice'),
    ('{"name": "f", "arguments": {}, "arguments": {"a": 1}}', '"arguments" twice'),
    ('{"name": "f", "parameters": {}, "parameters": {}}', '"parameters" twice'),
    ('{"name": "f", "arguments": {}, "parameters": {}}', 'both "arguments" and "parameters"'),
])
def test_an_ambiguous_call_is_unreadable(body, reason):
    text = f"<tool_call>{body}</tool_call>"
    turn = parse(text)
    assert turn.content == text and turn.tool_calls == [] and reason in turn.error


STREAMED = [
    'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x\\u00e9\\ud83d\\ude00\\"}"}}\n</tool_call>'
    '<tool_call>{"name":"mul","arguments":"{\\"a\\": 3}"}</tool_call> done',
    '<tool_call>{"arguments": {"deep": [{"k": "}]"}, 2.5e3, true, null]}, "name": "late"}</tool_call>',
    '<tool_call>{"name": "no_args"}</tool_call>\n\n<tool_call> {"parameters": -7 , "name" : "n"} </tool_call>',
    '<tool_call>{"name": "t\\u00e9st", "arguments": {"s": "</tool_"}}</tool_call>',
    'plain text only',
]


@pytest.mark.parametrize("text", STREAMED)
def test_streamed_calls_only_grow_and_end_as_the_parsed_calls(text):
    """Every prefix of a completion: a call's id and name, once given, stay; its arguments only
    grow; read is never past the text; and the whole text's calls are exactly the parsed ones."""
    before: list[dict] = []
    for length in range(len(text) + 1):
        calls = parse.stream_calls(text[:length])
        assert len(calls) >= len(before)
        for old, new in zip(before, calls):
            assert new["id"] == old["id"] and new["arguments"].startswith(old["arguments"])
            assert old["name"] is None or new["name"] == old["name"]
            assert old["end"] <= new["end"] <= length
        before = calls
    parsed = parse(text)
    assert parsed.error is None
    assert [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in before] == parsed.tool_calls


def test_streamed_calls_arrive_piece_by_piece():
    text = STREAMED[0]
    seen = {tuple((c["name"], c["arguments"]) for c in parse.stream_calls(text[:n])) for n in range(len(text) + 1)}
    first = {calls[0] for calls in seen if calls}
    assert ("add", "") in first  # the name before any of the arguments
    assert len({arguments for name, arguments in first if name == "add"}) > 20  # the arguments as they grow
    assert (None, "") in first  # the call begun, its name not yet complete
    string_args = {calls[1][1] for calls in seen if len(calls) > 1}
    assert string_args >= {"", "{", '{"', '{"a": 3}'}  # a string value decoded as it grows
    assert not any("\\" in a for a in string_args)  # never half an escape
    partial_close = parse.stream_calls('<tool_call>{"name": "f", "arguments": {"s": "a</tool_')
    assert partial_close[0]["arguments"] == '{"s": "a'  # what may become </tool_call> is held back


def test_streamed_calls_of_unreadable_texts_never_raise():
    import random

    rng = random.Random(1)
    alphabet = '<>/{}[]":,\\ u0d8e abfnrt tool_call name arguments 1.e-'
    for _ in range(300):
        text = "<tool_call>" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        for length in range(len(text) + 1):
            for call in parse.stream_calls(text[:length]):
                assert isinstance(call["arguments"], str) and call["end"] <= length


def test_a_streamed_string_argument_never_splits_a_character():
    emoji = '<tool_call>{"name": "e", "arguments": "\\ud83d\\ude00!\\q"}</tool_call>'
    grown = [parse.stream_calls(emoji[:n]) for n in range(len(emoji) + 1)]
    assert {calls[0]["arguments"] for calls in grown if calls} == {"", "\U0001f600", "\U0001f600!"}
    assert parse(emoji).error  # an invalid escape: the JSON does not parse, nothing after it was streamed


def _streaming(parse_fn, stream_calls=None, start="<tool_call>"):
    parse_fn.stream_start = start
    parse_fn.stream_calls = stream_calls or parse.stream_calls
    return parse_fn


@pytest.mark.parametrize("broken, says", [
    (_streaming(lambda text: ParsedTurn(parse(text).content, [
        {**c, "function": {**c["function"], "arguments": json.dumps(json.loads(c["function"]["arguments"]))}}
        for c in parse(text).tool_calls], parse(text).error)), "must end as the non-streamed one"),
    (_streaming(lambda text: parse(text), lambda text: [{**c, "arguments": c["arguments"][:3]}
                                                        for c in parse.stream_calls(text)]), "must end as"),
    (_streaming(lambda text: parse(text), lambda text: [{**c, "arguments": c["arguments"][::-1]}
                                                        for c in parse.stream_calls(text)]), "took back"),
    (_streaming(lambda text: parse(text), start=None), "no stream_start"),
], ids=["re-serialised", "short", "reversed", "no-start"])
def test_the_contract_check_catches_a_stream_that_disagrees_with_parse(broken, says):
    from rlhf.plugin_kit.checks.agents.tool_parser import check
    from rlhf.plugin_kit.checks.target import ContractError, Target

    with pytest.raises(ContractError, match=says):
        check(Target("tool_parser", "broken", broken))
    assert check(Target("tool_parser", "hermes", parse))[1:] == [
        "3 tool calls in OpenAI's shape, 2 unreadable texts given back as content with a reason", "deterministic",
        "streams tool calls: 3 calls grown character by character end as parse reads them"]


def _typeless(text):
    return ParsedTurn(parse(text).content, [{**c, "type": "fn"} for c in parse(text).tool_calls])


@pytest.mark.parametrize("broken, says", [
    (lambda text: ParsedTurn("?", error="unreadable") if "{" in text else ParsedTurn(text),
     "must give the raw text back as content"),
    (_typeless, "a tool call must be"),
    (_streaming(lambda text: parse(text), lambda text: tuple(parse.stream_calls(text))), "must return a list of"),
    (_streaming(lambda text: parse(text), lambda text: [{k: v for k, v in c.items() if k != "end"}
                                                        for c in parse.stream_calls(text)]), "must return a list of"),
], ids=["error-content", "type", "tuple", "no-end"])
def test_the_contract_check_catches_broken_turns_and_stream_shapes(broken, says):
    from rlhf.plugin_kit.checks.agents.tool_parser import check
    from rlhf.plugin_kit.checks.target import ContractError, Target

    with pytest.raises(ContractError, match=says):
        check(Target("tool_parser", "broken", broken))


@pytest.mark.parametrize("text, arguments", [
    ('<tool_call>{"name": "f", "arguments": "a b', "a b"),  # a string value as it grows, spaces and all
    ('<tool_call>{"name": "f", "arguments": "a\nb', "a"),  # a raw control character is not JSON: stops there
    ('<tool_call>{"name": "f", "arguments": "x\\u12G4yz"', "x"),  # nor is a \u escape that is not hex
    ('<tool_call>{"name": "f", "arguments": xy}</tool_call>', ""),  # no value starts with x
    ('<tool_call>{"name": "f", "arguments": {"s": "a</tool_call', '{"s": "a'),  # may still become </tool_call>
])
def test_what_a_call_so_far_cannot_be_sure_of_is_not_streamed(text, arguments):
    (call,) = parse.stream_calls(text)
    assert call["name"] == "f" and call["arguments"] == arguments


def test_the_top_level_of_an_object_stops_where_no_value_starts():
    from rlhf.plugins.tool_parsers.json_prefix import Member, read_object

    assert read_object('{"a": x, "b": 1}').members == ()
    assert read_object('{"a": 1, "b": @}').members == (Member("a", 6, 7),)
    assert read_object(' {"a" : [1, {"b": "]"}] , "c": tru').members == (Member("a", 8, 23), Member("c", 31, None))
