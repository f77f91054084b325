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
