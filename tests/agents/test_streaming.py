"""Streaming token by token and ``top_logprobs`` through the agent endpoint, with the ``hf`` engine
and the tiny model: content chunks arrive while the engine still decodes, their concatenation is
the non-streamed answer of the same seed, and the top alternatives of each sampled position are
those of a direct forward of the model at the run's temperature."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import torch

from rlhf.plugins.tool_parsers.hermes import parse
from rlhf.runtime.agents.endpoint import AgentEndpoint
from rlhf.runtime.agents.streaming import TextStream
from rlhf.runtime.agents.requests import RunSampling

pytestmark = pytest.mark.run

openai = pytest.importorskip("openai")


def run_sampling(temperature: float = 1.0) -> RunSampling:
    return RunSampling(temperature=temperature, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=24,
                       max_total_tokens=400)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, tokenizer


class Slowed:
    """The hf engine, each sampled token reported after 20 ms (so a stream has time to arrive), and
    the moment each completion ended."""

    shares_weights = True

    def __init__(self, engine):
        self.engine, self.eos_ids, self.ended = engine, engine.eos_ids, []

    async def generate_one(self, prompt_ids, params, *, on_token=None, top_logprobs=0):
        def slowed(*args):
            time.sleep(0.02)
            if on_token is not None:
                on_token(*args)

        generation = await self.engine.generate_one(prompt_ids, params, on_token=slowed, top_logprobs=top_logprobs)
        self.ended.append(time.monotonic())
        return generation


def serve(model_and_tokenizer, run=None, engine=None):
    from rlhf.plugins.engines.hf import HFEngine

    model, tokenizer = model_and_tokenizer
    engine = engine or HFEngine(model, tokenizer)
    return AgentEndpoint(engine, tokenizer, parse, run or run_sampling(), model_name="policy", continuous=True), engine


def test_a_streamed_answer_arrives_token_by_token_and_is_the_answer_of_the_same_seed(model_and_tokenizer):
    from rlhf.plugins.engines.hf import HFEngine

    model, tokenizer = model_and_tokenizer
    slowed = Slowed(HFEngine(model, tokenizer))
    server, _ = serve(model_and_tokenizer, engine=slowed)
    try:
        messages = [{"role": "user", "content": "Tell me a long story about numbers."}]
        _, plain, plain_record = server.open(0, 1234)  # the same trajectory index and seed: the same tokens
        whole = plain.openai().chat.completions.create(model=plain.model, messages=messages)
        _, streamed, streamed_record = server.open(0, 1234)
        arrivals, pieces = [], []
        for chunk in streamed.openai().chat.completions.create(model=streamed.model, messages=messages, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
                pieces.append(chunk.choices[0].delta.content)
            last = chunk
        answer = whole.choices[0].message.content
        assert len(answer) > 10 and whole.usage.completion_tokens >= 8, answer
        assert "".join(pieces) == answer
        assert len(pieces) > 3  # several content chunks, not one piece at the end
        assert arrivals[0] < slowed.ended[-1] - 0.05  # the first came while the engine still decoded
        assert last.choices[0].finish_reason == whole.choices[0].finish_reason
        assert streamed_record.sequences[0].tokens == plain_record.sequences[0].tokens  # recorded alike
    finally:
        server.stop()


def test_completions_stream_too(model_and_tokenizer):
    server, _ = serve(model_and_tokenizer)
    try:
        _, plain, _ = server.open(3, 99)
        ids = model_and_tokenizer[1]("Once upon a time", add_special_tokens=False)["input_ids"]
        whole = plain.openai().completions.create(model=plain.model, prompt=ids)
        _, streamed, _ = server.open(3, 99)
        pieces = [c.choices[0].text for c in streamed.openai().completions.create(model=streamed.model, prompt=ids,
                                                                                  stream=True)]
        assert "".join(pieces) == whole.choices[0].text and sum(bool(p) for p in pieces) > 1
    finally:
        server.stop()


def test_top_logprobs_are_the_sampling_distributions_top_k_of_a_direct_forward(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    server, _ = serve(model_and_tokenizer, run=run_sampling(temperature=0.7))
    try:
        _, endpoint, record = server.open(0, 5)
        reply = endpoint.openai().chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": "Count."}], max_tokens=6, logprobs=True,
            top_logprobs=5)
        (sequence,) = record.sequences
        sampled = [t for t, m in zip(sequence.tokens, sequence.mask) if m]
        start = len(sequence.tokens) - len(sampled)
        with torch.no_grad():
            logits = model(torch.tensor([sequence.tokens])).logits[0].float()  # (T, V)
        expected = torch.log_softmax(logits / 0.7, dim=-1)[start - 1:-1]  # (N, V) the distribution of each sampled token
        content = reply.choices[0].logprobs.content
        assert len(content) == len(sampled) >= 2
        for position, (entry, token) in enumerate(zip(content, sampled)):
            values, ids = expected[position].topk(5)
            assert [top.token for top in entry.top_logprobs] == [tokenizer.decode([i]) for i in ids.tolist()]
            assert [top.logprob for top in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
            assert entry.logprob == pytest.approx(float(expected[position, token]), abs=1e-5)
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
        bad = endpoint.openai().with_options(max_retries=0)
        with pytest.raises(openai.BadRequestError, match="top_logprobs must be an integer from 0 to 20"):
            bad.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": "x"}],
                                        logprobs=True, top_logprobs=21)
        request = urllib.request.Request(f"{endpoint.base_url}/completions", method="POST", data=json.dumps(
            {"model": "policy", "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 3}).encode(), headers={
            "Authorization": f"Bearer {endpoint.api_key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            legacy = json.load(response)["choices"][0]["logprobs"]
        assert len(legacy["top_logprobs"]) == len(legacy["tokens"]) and all(len(t) <= 3 for t in legacy["top_logprobs"])
    finally:
        server.stop()


class Chars:
    """A tokenizer stand-in: each id is a character."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class Template:
    def decode(self, ids, special=True):
        return Chars().decode(ids)


def test_text_deltas_never_take_back_what_they_sent():
    stream = TextStream(Template(), holdback=("STOP", "<|im_end|>"), tool_start=None, streams=True)
    deltas = [stream.add(ord(c)) for c in "Hello ST"]
    assert "".join(deltas) == "Hello " and stream.sent == "Hello "  # "ST" may become "STOP": held back
    deltas = [stream.add(ord(c)) for c in "AR<|im_e"]
    assert "".join(deltas) == "STAR" and stream.sent == "Hello STAR"
    tools = TextStream(Template(), holdback=(), tool_start="<tool_call>", streams=True)
    deltas = [tools.add(ord(c)) for c in 'Let me add. <tool_ca']
    assert "".join(deltas) == "Let me add."  # trailing space and a possible tool call held back
    assert [tools.add(ord(c)) for c in 'll>{"name"'] == [""] * 10


# --- log-probs per chunk and tool calls argument by argument -----------------------------------------------


def sse(endpoint, path, body):
    """The events of a streamed answer read off the wire (raw HTTP): each ``data:`` payload, up to [DONE]."""
    request = urllib.request.Request(f"{endpoint.base_url}/{path}", method="POST", data=json.dumps(
        {"model": endpoint.model, "stream": True, **body}).encode(), headers={
        "Authorization": f"Bearer {endpoint.api_key}", "Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for line in response.read().decode().splitlines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def released_by_content(tokenizer, ids, chunks):
    """For every chunk with content: (tokens whose log-probs went out by then, tokens up to the last
    one that shows text within the content sent by then): equal when each chunk carries exactly the
    tokens whose text it releases (a token that shows none, the end of turn, goes with a later chunk)."""
    from rlhf.runtime.agents.logprobs import token_ends
    from rlhf.runtime.agents.template import ChatTemplate

    ends = token_ends(ChatTemplate(tokenizer), ids)
    shows = [tokenizer.decode([token], skip_special_tokens=True) != "" for token in ids]
    pairs, sent, carried = [], "", 0
    for content, entries in chunks:
        carried += entries
        if content:
            sent += content
            pairs.append((carried, max(i + 1 for i, end in enumerate(ends) if end <= len(sent) and shows[i])))
    return pairs


def test_each_chat_chunk_carries_the_logprobs_of_the_tokens_it_releases(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    server, _ = serve(model_and_tokenizer)
    try:
        messages = [{"role": "user", "content": "Tell me a long story about numbers."}]
        asked = dict(messages=messages, logprobs=True, top_logprobs=3, max_tokens=20)
        _, plain, plain_record = server.open(0, 77)
        whole = plain.openai().chat.completions.create(model=plain.model, **asked)
        expected = [entry.model_dump() for entry in whole.choices[0].logprobs.content]
        assert len(expected) == whole.usage.completion_tokens >= 10 and all(len(e["top_logprobs"]) == 3
                                                                              for e in expected)

        _, streamed, record = server.open(0, 77)  # the same seed: the same tokens
        chunks = list(streamed.openai().chat.completions.create(model=streamed.model, stream=True, **asked))
        entries = [[e.model_dump() for e in c.choices[0].logprobs.content] if c.choices[0].logprobs else []
                   for c in chunks]
        assert [e for these in entries for e in these] == expected  # joined: the whole answer's
        assert sum(bool(these) for these in entries) > 3  # spread over the chunks, not all in the last
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
        ids = [t for t, m in zip(record.sequences[0].tokens, record.sequences[0].mask) if m]
        pairs = released_by_content(tokenizer, ids, [(c.choices[0].delta.content, len(e))
                                                     for c, e in zip(chunks, entries)])
        assert pairs and all(carried == released for carried, released in pairs), pairs

        raw = sse(server.open(0, 77)[1], "chat/completions", asked)  # raw HTTP: the same chunks' log-probs
        assert [e for event in raw if event["choices"][0]["logprobs"]
                for e in event["choices"][0]["logprobs"]["content"]] == expected

        _, helped, _ = server.open(0, 77)  # the SDK's stream helper accumulates them into the whole answer's
        with helped.openai().chat.completions.stream(model=helped.model, **asked) as events:
            for _ in events:
                pass
            final = events.current_completion_snapshot  # (get_final_completion refuses an answer cut by length)
        assert [e.model_dump() for e in final.choices[0].logprobs.content] == expected
        assert final.choices[0].message.content == whole.choices[0].message.content
        assert plain_record.sequences[0].tokens == record.sequences[0].tokens
    finally:
        server.stop()


def test_each_completions_chunk_carries_the_legacy_logprobs_of_its_tokens(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    server, _ = serve(model_and_tokenizer)
    try:
        ids = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
        asked = dict(prompt=ids, logprobs=3, max_tokens=20)
        _, plain, _ = server.open(3, 99)
        whole = plain.openai().completions.create(model=plain.model, **asked)
        expected = whole.choices[0].logprobs.model_dump()
        text = whole.choices[0].text
        count = len(whole.choices[0].token_ids)
        assert count >= 10 and [len(expected[k]) for k in ("tokens", "token_logprobs", "top_logprobs",
                                                           "text_offset")] == [count] * 4
        offsets = expected["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
        from rlhf.runtime.agents.logprobs import token_ends
        from rlhf.runtime.agents.template import ChatTemplate

        ends = token_ends(ChatTemplate(tokenizer), whole.choices[0].token_ids)
        assert offsets[1:] == [min(end, len(text)) for end in ends[:-1]]  # where each token's text starts

        for events in (sse(server.open(3, 99)[1], "completions", asked),
                       [c.model_dump() for c in server.open(3, 99)[1].openai().completions.create(
                           model="policy", stream=True, **asked)]):
            joined = {key: [] for key in expected}
            pieces = [event["choices"][0] for event in events]
            for piece in pieces:
                for key in joined:
                    joined[key] += (piece["logprobs"] or {}).get(key) or []
            assert joined == expected
            assert "".join(p["text"] for p in pieces) == text and sum(bool(p["logprobs"]) for p in pieces) > 3
            pairs = released_by_content(tokenizer, whole.choices[0].token_ids, [
                (p["text"], len((p["logprobs"] or {}).get("tokens") or [])) for p in pieces])
            assert all(carried == released for carried, released in pairs), pairs
    finally:
        server.stop()


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in ("add", "mul")]
TWO_CALLS = ('Let me see. <tool_call>{"name":"add","arguments":{"a":1,"b":[22, 3],"note":"caf\\u00e9 </tool"}}'
             '</tool_call>\n<tool_call>\n{"name": "mul", "arguments": {"x": -2.5e1}}\n</tool_call><|im_end|>')


class Typing:
    """Answers each request with its scripted text, token by token (``on_token``), each token's
    log-prob -0.01 x its position, and (with ``top_logprobs``) two made-up alternatives; a stop string
    ends it at the token that completes it, as the engines do."""

    shares_weights = True

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.eos_ids = {tokenizer.eos_token_id}

    async def generate_one(self, prompt_ids, params, *, on_token=None, top_logprobs=0):
        import asyncio

        from rlhf.core.protocols.rollout import Generation

        ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"][:params.max_new_tokens]
        stop = None
        for count in range(1, len(ids) + 1):
            stop = next((s for s in params.stop if s in self.tokenizer.decode(ids[:count])), None)
            if stop is not None:
                ids = ids[:count]
                break
        logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
        tops = [[(t, lp), ((t + 1) % 300, lp - 1.0)][:top_logprobs] for t, lp in zip(ids, logprobs)]
        for token, logprob, alternatives in zip(ids, logprobs, tops):
            await asyncio.sleep(0)
            if on_token is not None:
                on_token(token, logprob, alternatives if top_logprobs else [])
        return Generation(token_ids=ids, finish_reason="stop", logprobs=logprobs, stop_string=stop,
                          extra={"top_logprobs": tops} if top_logprobs else {})


@pytest.fixture
def typing_server(tiny_model_dir):
    from transformers import AutoTokenizer

    from tests.agents.templates import REWRITING

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = REWRITING
    servers = []

    def start(*replies, engine=Typing):
        run = RunSampling(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=300,
                          max_total_tokens=1000)
        server = AgentEndpoint(engine(tokenizer, replies), tokenizer, parse, run, model_name="policy", continuous=True)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def tool_deltas(events):
    return [(call, event["choices"][0]) for event in events for call in event["choices"][0]["delta"].get("tool_calls")
            or []]


def test_tool_calls_stream_argument_by_argument_and_end_as_the_whole_answer(typing_server):
    server = typing_server(*[TWO_CALLS] * 3)
    asked = dict(messages=[{"role": "user", "content": "Add, then multiply."}], tools=TOOLS, logprobs=True,
                 top_logprobs=2)
    _, plain, plain_record = server.open(0, 5)
    whole = plain.openai().chat.completions.create(model=plain.model, **asked)
    calls = [call.model_dump() for call in whole.choices[0].message.tool_calls]
    assert [c["function"]["arguments"] for c in calls] == ['{"a":1,"b":[22, 3],"note":"caf\\u00e9 </tool"}',
                                                           '{"x": -2.5e1}']  # the model's own text
    expected_logprobs = [e.model_dump() for e in whole.choices[0].logprobs.content]

    _, raw_endpoint, raw_record = server.open(0, 5)
    events = sse(raw_endpoint, "chat/completions", asked)
    deltas = tool_deltas(events)
    first = [call for call, _ in deltas if "id" in call]
    assert first == [{"index": i, "id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                                                  "arguments": ""}}
                     for i, c in enumerate(calls)]  # a header per call: index, id, type, name, arguments ""
    for index, call in enumerate(calls):
        pieces = [d["function"]["arguments"] for d, _ in deltas if d["index"] == index and "id" not in d]
        assert len(pieces) > 5 and all(pieces)  # the arguments fragment by fragment
        assert "".join(pieces) == call["function"]["arguments"]
        assert all(set(d) == {"index", "function"} for d, _ in deltas if d["index"] == index and "id" not in d)
    assert [d["index"] for d, _ in deltas] == sorted(d["index"] for d, _ in deltas)
    arrived = [i for i, event in enumerate(events) if event["choices"][0]["delta"].get("tool_calls")]
    assert arrived[0] < len(events) - 10  # while the answer was still generated, not all at its end
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "Let me see."
    assert [e for event in events if event["choices"][0]["logprobs"]
            for e in event["choices"][0]["logprobs"]["content"]] == expected_logprobs
    assert sum(bool(choice["logprobs"]) for _, choice in deltas) > 5  # the call's tokens with its deltas

    _, helped, helped_record = server.open(0, 5)  # the SDK's stream helper accumulates the same message
    with helped.openai().chat.completions.stream(model=helped.model, **asked) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert [call.model_dump(exclude={"index": True, "function": {"parsed_arguments"}}) for call in message.tool_calls
            ] == calls and [call.index for call in message.tool_calls] == [0, 1]
    assert message.content == whole.choices[0].message.content and final.choices[0].finish_reason == "tool_calls"
    assert [e.model_dump() for e in final.choices[0].logprobs.content] == expected_logprobs
    assert plain_record.sequences[0].tokens == raw_record.sequences[0].tokens == helped_record.sequences[0].tokens
    assert plain_record.parse_failures == raw_record.parse_failures == helped_record.parse_failures == []


def test_an_unreadable_streamed_call_ends_as_the_non_streamed_answer(typing_server):
    broken = 'I add. <tool_call>{"name": "add", "arguments": {"a": 1}</tool_call> ok<|im_end|>'  # a brace short
    server = typing_server(broken, broken)
    asked = dict(messages=[{"role": "user", "content": "Add."}], tools=TOOLS)
    _, plain, plain_record = server.open(0, 5)
    whole = plain.openai().chat.completions.create(model=plain.model, **asked).choices[0]
    assert whole.message.tool_calls is None and whole.finish_reason == "stop"
    assert whole.message.content == broken.removesuffix("<|im_end|>")

    _, streamed, record = server.open(0, 5)
    events = sse(streamed, "chat/completions", asked)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == whole.message.content
    assert events[-1]["choices"][0]["finish_reason"] == "stop"  # not "tool_calls": the streamed call is void
    streamed = tool_deltas(events)  # what went out before the call proved unreadable stays (docs/agents.md)
    assert streamed[0][0]["function"] == {"name": "add", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d, _ in streamed) == '{"a": 1}'
    assert len(record.parse_failures) == len(plain_record.parse_failures) == 1  # recorded alike
    assert record.sequences[0].tokens == plain_record.sequences[0].tokens



def test_a_stop_strings_tokens_come_with_the_last_chunk_where_the_text_ends(typing_server):
    server = typing_server(*["Hello there STOP and more"] * 3)
    asked = dict(prompt=[5, 6, 7], logprobs=2, stop=["STOP"])
    _, plain, _ = server.open(0, 5)
    whole = plain.openai().completions.create(model="policy", **asked).choices[0]
    assert whole.text == "Hello there " and whole.finish_reason == "stop"
    expected = whole.logprobs.model_dump()
    assert expected["tokens"][-4:] == list("STOP") and expected["text_offset"][-5:] == [11] + [12] * 4
    for events in (sse(server.open(0, 5)[1], "completions", asked),
                   [c.model_dump() for c in server.open(0, 5)[1].openai().completions.create(
                       model="policy", stream=True, **asked)]):
        pieces = [event["choices"][0] for event in events]
        assert "".join(p["text"] for p in pieces) == whole.text and pieces[-1]["finish_reason"] == "stop"
        assert pieces[-1]["logprobs"]["tokens"] == list("STOP")  # shown nowhere: with the last chunk
        joined = {key: [t for p in pieces for t in (p["logprobs"] or {}).get(key) or []] for key in expected}
        assert joined == expected


class TypingAlone(Typing):
    """`Typing` for an engine that streams but offers no alternatives (no ``top_logprobs`` keyword)."""

    async def generate_one(self, prompt_ids, params, *, on_token=None):
        return await super().generate_one(prompt_ids, params, on_token=on_token)


def test_without_the_engines_alternatives_each_streamed_token_is_its_own_top(typing_server):
    server = typing_server(*["Hello there, numbers."] * 2, engine=TypingAlone)
    asked = dict(messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2)
    _, plain, _ = server.open(0, 5)
    expected = [e.model_dump() for e in plain.openai().chat.completions.create(
        model="policy", **asked).choices[0].logprobs.content]
    assert len(expected) > 5 and all(e["top_logprobs"] == [{k: e[k] for k in ("token", "logprob", "bytes")}]
                                     for e in expected)
    chunks = sse(server.open(0, 5)[1], "chat/completions", asked)
    assert [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]] == expected
