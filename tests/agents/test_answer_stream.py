"""The chunks of a streamed answer without a model (`rlhf.runtime.agents.streaming.AnswerStream`,
characters as tokens): each names the tokens whose text it releases, tool calls come as a header and
argument fragments as a parser's ``stream_calls`` reads them and end as ``parse`` reads the answer,
a parser without it has each call sent whole at the end, an unreadable call ends with the raw text."""

from __future__ import annotations

import pytest

from rlhf.plugins.tool_parsers.hermes import parse
from rlhf.runtime.agents.streaming import AnswerStream, StreamBroken

pytestmark = pytest.mark.unit


class Template:
    """A chat template stand-in whose tokens are characters (``ord``)."""

    def decode(self, ids, special=True):
        return "".join(chr(i) for i in ids)


def stream_chars(stream, text):
    return [chunk for char in text for chunk in stream.add(ord(char))]


def test_each_chunk_names_the_tokens_whose_text_it_releases():
    stream = AnswerStream(Template(), holdback=("STOP", "<|im_end|>"))
    text = "Hi STAR STOP"
    chunks = stream_chars(stream, text)
    assert [c.delta["content"] for c in chunks] == list("Hi ") + ["STA", "R", " "]  # "ST" waited for "A"
    assert [c.tokens for c in chunks] == [range(0, 1), range(1, 2), range(2, 3), range(3, 6), range(6, 7),
                                          range(7, 8)]
    assert stream.finish([ord(c) for c in text], "Hi STAR ", None, len("Hi STAR ")) == []
    assert stream.rest(len(text)) == range(8, 12)  # the stop string's tokens: with the last chunk
    assert stream.rest(len(text)) == range(12, 12)


def test_tool_call_chunks_with_their_tokens_and_the_finish_that_completes_them():
    text = 'Sum: <tool_call>{"name": "add", "arguments": {"a": 12}}</tool_call><tool_call>{"name": "f"}</tool_call>'
    stream = AnswerStream(Template(), holdback=("<|im_end|>",), parser=parse)
    chunks = stream_chars(stream, text)
    assert [c.delta for c in chunks[:4]] == [{"content": c} for c in "Sum:"]
    deltas = [c.delta["tool_calls"][0] for c in chunks[4:]]
    assert deltas[0] == {"index": 0, "id": "call_0", "type": "function", "function": {"name": "add", "arguments": ""}}
    assert [d["function"]["arguments"] for d in deltas[1:10]] == ["{", *'"a": 12', "}"]  # as they are generated
    assert all(set(d) == {"index", "function"} and d["index"] == 0 for d in deltas[1:10])
    assert deltas[10:] == [{"index": 1, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}},
                           {"index": 1, "function": {"arguments": "{}"}}]
    released = ["".join(text[i] for i in c.tokens) for c in chunks]
    assert released[:4] == list("Sum:")  # each chunk: the tokens of its text, in order
    assert released[4:7] == [' <tool_call>{"name": "add"', ', "arguments": {', '"']
    assert released[-2:] == ['}</tool_call><tool_call>{"name": "f"', "}"]
    assert "".join(released) == text[:91]
    parsed = parse(text)
    assert stream.finish([ord(c) for c in text], parsed.content, parsed.tool_calls, len(text)) == []
    assert stream.rest(len(text)) == range(91, len(text))  # "</tool_call>", which shows nothing: the last chunk


def test_a_parser_without_stream_calls_sends_each_call_whole_at_the_end():
    def whole_calls(text):
        return parse(text)

    whole_calls.stream_start = "<tool_call>"
    text = 'Hm <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    stream = AnswerStream(Template(), holdback=(), parser=whole_calls)
    chunks = stream_chars(stream, text)
    assert [c.delta for c in chunks] == [{"content": "H"}, {"content": "m"}]
    parsed = parse(text)
    end = stream.finish([ord(c) for c in text], parsed.content, parsed.tool_calls, len(text))
    whole = [{"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                              "function": {"name": "add", "arguments": ""}}]},
             {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}]
    assert [c.delta for c in end] == whole
    assert stream.rest(len(text)) == range(2, len(text))
    no_start = AnswerStream(Template(), holdback=(), parser=lambda text: parse(text))  # no stream_start: all at the end
    assert stream_chars(no_start, text) == []
    end = no_start.finish([ord(c) for c in text], parsed.content, parsed.tool_calls, len(text))
    assert [c.delta for c in end] == [*whole, {"content": "Hm"}]


def test_an_unreadable_call_ends_with_the_raw_text_and_a_disagreeing_parser_breaks_the_stream():
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>'
    stream = AnswerStream(Template(), holdback=(), parser=parse)
    assert [c.delta.get("content") for c in stream_chars(stream, text)][:2] == ["o", "k"]
    end = stream.finish([ord(c) for c in text], text, None, len(text))  # None: parse could not read it
    assert [c.delta for c in end] == [{"content": text[2:]}] and end[0].tokens.stop == len(text)

    again = AnswerStream(Template(), holdback=(), parser=parse)
    stream_chars(again, text.replace("}</", "}}</"))
    other = [{"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]
    with pytest.raises(StreamBroken, match="stream_calls and parse disagree"):
        again.finish([], None, other, 0)
    with pytest.raises(StreamBroken, match="1 tool calls were streamed, the answer has 0"):
        again.finish([], None, [], 0)


class Special(Template):
    """Id 0 is a special token: no text when special tokens are left out."""

    def decode(self, ids, special=True):
        return "".join("<s>" if i == 0 and special else "" if i == 0 else chr(i) for i in ids)


def test_where_each_token_ends_as_streamed_is_where_the_whole_answer_says():
    from rlhf.runtime.agents.logprobs import text_offsets, token_ends

    ids = [0, ord("a"), 0, ord("b"), ord("c")]
    stream = AnswerStream(Special(), holdback=())
    chunks = [chunk for token in ids for chunk in stream.add(token)]
    assert stream.text.ends == token_ends(Special(), ids) == [0, 1, 1, 2, 3]
    assert text_offsets(stream.text.ends, 0, 5, 3) == [0, 0, 1, 1, 2]  # where each token's text starts
    assert [c.tokens for c in chunks] == [range(0, 2), range(2, 4), range(4, 5)]  # a special token: with the next


def test_tokens_the_engine_reported_beyond_its_answer_are_never_released():
    stream = AnswerStream(Special(), holdback=())
    stream.text.streams = False  # as for a parser without stream_start: the text goes out at the end
    for token in [*map(ord, "abcd"), 0, 0]:  # two tokens that show no text, beyond the answer
        stream.add(token)
    (chunk,) = stream.finish([ord(c) for c in "abcd"], "abcd", None, 4)
    assert chunk.delta == {"content": "abcd"} and chunk.tokens == range(0, 4)
    assert stream.rest(4) == range(4, 4)


def test_a_generation_without_logprobs_or_alternatives_reports_zero_and_the_token_alone():
    from rlhf.core.protocols.rollout import Generation
    from rlhf.runtime.agents.logprobs import Sampled, chat_logprobs, legacy_logprobs, sampled_of

    bare = sampled_of(Generation(token_ids=[104, 105], finish_reason="stop"), top=2)
    assert bare == [Sampled(104, 0.0, None), Sampled(105, 0.0, None)]
    entries = chat_logprobs(Template(), bare, 2)["content"]
    assert [e["top_logprobs"] for e in entries] == [[{"token": "h", "logprob": 0.0, "bytes": [104]}],
                                                    [{"token": "i", "logprob": 0.0, "bytes": [105]}]]
    assert "top_logprobs" not in legacy_logprobs(Template(), bare, 2, [0, 1])  # none offered: none claimed
    some = sampled_of(Generation(token_ids=[104, 105], finish_reason="stop", logprobs=[-1.0, -2.0],
                                 extra={"top_logprobs": [[(104, -1.0), (97, -3.0), (98, -4.0)]]}), top=2)
    assert some == [Sampled(104, -1.0, [(104, -1.0), (97, -3.0), (98, -4.0)]), Sampled(105, -2.0, None)]
    assert legacy_logprobs(Template(), some[:1], 2, [0]) == {"tokens": ["h"], "token_logprobs": [-1.0],
                                                             "top_logprobs": [{"h": -1.0, "a": -3.0}],
                                                             "text_offset": [0]}


def test_an_answer_that_starts_with_a_tool_call_or_a_stop_string_streams_no_content():
    text = '<tool_call>{"name": "f"}</tool_call>'
    chunks = stream_chars(AnswerStream(Template(), holdback=("STOP",), parser=parse), text)
    assert not [c for c in chunks if "content" in c.delta] and len(chunks) == 2  # the header and "{}"
    assert stream_chars(AnswerStream(Template(), holdback=("STOP",)), "STOP and more") == []


class Cleanup(Template):
    """A decoder that rewrites earlier text as more comes (" ," -> ","), as some tokenizers' clean-up does."""

    def decode(self, ids, special=True):
        return super().decode(ids).replace(" ,", ",")


def test_a_decoder_that_rewrites_earlier_text_gets_no_delta_that_contradicts_what_went_out():
    stream = AnswerStream(Cleanup(), holdback=())
    chunks = stream_chars(stream, "a ,b")
    assert [c.delta["content"] for c in chunks] == ["a", " "] and stream.text.sent == "a "  # never "b" after "a "
