"""The agent endpoint through the real ``openai`` client and raw HTTP: multi-turn chat with tool
calls recorded token for token, token-in-token-out completions, streaming, the run's sampling and
budgets enforced, bad requests answered 400/401 with a message while the endpoint goes on serving,
and (with the tiny model) the recorded log-probs equal to the trainer's at temperature 1."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from rlhf.core.protocols.rollout import Generation
from rlhf.plugins.tool_parsers.hermes import parse
from rlhf.runtime.agents.endpoint import AgentEndpoint
from rlhf.runtime.agents.requests import RunSampling
from tests.agents.templates import REWRITING

pytestmark = pytest.mark.run

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
CALL = '<think>Add them.</think>\n<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call><|im_end|>'
RUN = RunSampling(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=200,
                  max_total_tokens=1000)


class ScriptedEngine:
    """Answers each request with the next scripted text; records what it was asked to continue."""

    shares_weights = True

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.eos_ids = {tokenizer.eos_token_id}
        self.requests: list[tuple[list[int], object]] = []
        self.sampled: list[list[int]] = []

    async def generate_one(self, prompt_ids, params):
        self.requests.append((list(prompt_ids), params))
        ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"][:params.max_new_tokens]
        self.sampled.append(ids)
        return Generation(token_ids=ids, finish_reason="stop", logprobs=[-0.5] * len(ids))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = REWRITING
    return tokenizer


@pytest.fixture
def serve(tokenizer):
    started = []

    def start(engine, run=RUN):
        endpoint = AgentEndpoint(engine, tokenizer, parse, run, model_name="policy", continuous=True)
        started.append(endpoint)
        start.server = endpoint
        return endpoint.open(0, 1234)

    yield start
    for endpoint in started:
        endpoint.stop()


def post(url, body, key, *, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_multi_turn_chat_with_tool_calls_is_recorded_token_for_token(tokenizer, serve):
    engine = ScriptedEngine(tokenizer, [CALL, "It is 3.<|im_end|>"])
    _, endpoint, record = serve(engine)
    client = endpoint.openai()
    messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 1 + 2?"}]
    first = client.chat.completions.create(model=endpoint.model, messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert choice.message.content == "<think>Add them.</think>"
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    second = client.chat.completions.create(model=endpoint.model, messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "It is 3." and second.choices[0].finish_reason == "stop"
    assert second.usage.completion_tokens == len(engine.sampled[1])

    (sequence,) = record.sequences
    (prompt1, params1), (prompt2, _) = engine.requests
    assert prompt2[:len(prompt1) + len(engine.sampled[0])] == prompt1 + engine.sampled[0]  # never re-tokenised
    assert [t for t, m in zip(sequence.tokens, sequence.mask) if m] == engine.sampled[0] + engine.sampled[1]
    assert sequence.tokens == prompt2 + engine.sampled[1]
    assert [lp for lp, m in zip(sequence.logprobs, sequence.mask) if m] == [-0.5] * sum(map(len, engine.sampled))
    assert record.drift == 1  # the template stripped the reasoning and re-serialised the call: spliced
    assert params1.temperature == 1.0 and params1.return_logprobs and params1.seed is not None
    assert "<|im_end|>" in params1.stop  # the template's end of turn ends a completion


def test_streaming_sends_the_same_answer_as_chunks(tokenizer, serve):
    engine = ScriptedEngine(tokenizer, ["Hello there<|im_end|>", CALL])
    _, endpoint, record = serve(engine)
    client = endpoint.openai()
    chunks = list(client.chat.completions.create(model=endpoint.model, stream=True,
                                                 messages=[{"role": "user", "content": "Hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there"
    assert chunks[-1].choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=endpoint.model, stream=True, tools=TOOLS,
                                                 messages=[{"role": "user", "content": "Add"}]))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "add" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert record.requests == 2


def test_completions_take_token_ids_and_extend_by_token_prefix(tokenizer, serve):
    engine = ScriptedEngine(tokenizer, ["abc", "def", "ghi"])
    _, endpoint, record = serve(engine)
    url, key = endpoint.base_url, endpoint.api_key
    status, first = post(f"{url}/completions", {"model": "policy", "prompt": [5, 6, 7], "logprobs": 1}, key)
    assert status == 200
    choice = first["choices"][0]
    assert choice["text"] == "abc" and choice["prompt_token_ids"] == [5, 6, 7]
    assert choice["logprobs"]["token_logprobs"] == [-0.5] * len(choice["token_ids"])
    status, second = post(f"{url}/completions", {"prompt": [5, 6, 7] + choice["token_ids"] + [9]}, key)
    assert status == 200
    (sequence,) = record.sequences
    assert sequence.tokens == [5, 6, 7] + choice["token_ids"] + [9] + second["choices"][0]["token_ids"]
    status, text = post(f"{url}/completions", {"prompt": "What"}, key)  # text works too (and starts a segment)
    assert status == 200 and text["choices"][0]["text"] == "ghi" and len(record.sequences) == 2
    with urllib.request.urlopen(urllib.request.Request(f"{url}/models", headers={
            "Authorization": f"Bearer {key}"})) as response:
        assert [m["id"] for m in json.load(response)["data"]] == ["policy"]


@pytest.mark.parametrize("change, status, says", [
    ({"key": "wrong"}, 401, "API key"),
    ({"body": {"model": "gpt-4o"}}, 400, "unknown model 'gpt-4o'"),
    ({"raw": b"{not json"}, 400, "not JSON"),
    ({"body": {"messages": [{"role": "robot", "content": "hi"}]}}, 400, "role is 'robot'"),
    ({"body": {"temperature": 0.3}}, 400, "run's temperature (1.0)"),
    ({"body": {"top_p": 0.9}}, 400, "top_p"),
    ({"body": {"n": 2}}, 400, "one completion per request"),
    ({"body": {"tool_choice": "required"}}, 400, "tool_choice"),
    ({"body": {"max_tokens": 0}}, 400, "max_tokens"),
])
def test_bad_requests_are_answered_with_a_message_and_the_endpoint_goes_on(tokenizer, serve, change, status, says):
    engine = ScriptedEngine(tokenizer, ["fine<|im_end|>"])
    trajectory, endpoint, record = serve(engine)
    good = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}]}
    got, answer = post(f"{endpoint.base_url}/chat/completions", {**good, **change.get("body", {})},
                       change.get("key", endpoint.api_key), raw=change.get("raw"))
    assert got == status
    assert says in answer["error"]["message"] and answer["error"]["type"] and answer["error"]["code"]
    assert engine.requests == [] and record.sequences == []  # nothing generated, nothing recorded
    got, answer = post(f"{endpoint.base_url}/chat/completions", good, endpoint.api_key)
    assert got == 200 and answer["choices"][0]["message"]["content"] == "fine"


def test_the_openai_client_sees_the_error_message(tokenizer, serve):
    _, endpoint, _ = serve(ScriptedEngine(tokenizer, []))
    with pytest.raises(openai.BadRequestError, match="run's temperature"):
        endpoint.openai(max_retries=0).chat.completions.create(
            model="policy", temperature=0.2, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endpoint.base_url, api_key="nope", max_retries=0).models.list()


def test_an_unreadable_tool_call_is_content_and_a_recorded_parse_failure(tokenizer, serve):
    engine = ScriptedEngine(tokenizer, ['<tool_call>{"name": add}</tool_call><|im_end|>'])
    _, endpoint, record = serve(engine)
    reply = endpoint.openai().chat.completions.create(model="policy", tools=TOOLS,
                                                      messages=[{"role": "user", "content": "Add"}])
    message = reply.choices[0].message
    assert message.content == '<tool_call>{"name": add}</tool_call>' and not message.tool_calls
    assert len(record.parse_failures) == 1 and "not JSON" in record.parse_failures[0]


def test_max_tokens_is_capped_by_the_run_and_the_budget_is_enforced(tokenizer, serve):
    engine = ScriptedEngine(tokenizer, ["x<|im_end|>", "y<|im_end|>"])
    hi = [{"role": "user", "content": "Hi"}]
    prompt = len(tokenizer(tokenizer.apply_chat_template(hi, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"])
    tight = RunSampling(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=5,
                        max_total_tokens=prompt + 3)
    _, endpoint, record = serve(engine, tight)
    status, _ = post(f"{endpoint.base_url}/chat/completions", {"messages": hi, "max_tokens": 1000}, endpoint.api_key)
    assert status == 200 and engine.requests[0][1].max_new_tokens == 3  # the trajectory's budget left
    status, _ = post(f"{endpoint.base_url}/chat/completions", {"messages": hi, "max_tokens": 2}, endpoint.api_key)
    assert status == 200 and engine.requests[1][1].max_new_tokens == 2
    status, answer = post(f"{endpoint.base_url}/chat/completions", {"messages": [
        {"role": "user", "content": "A long question that does not fit in the budget"}]}, endpoint.api_key)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert len(record.sequences) == 2 and record.requests == 2  # the refused request left nothing behind


def test_recorded_logprobs_are_the_trainers_at_temperature_one(tiny_model_dir, tokenizer, serve):
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.core.logprobs import token_logprobs
    from rlhf.plugins.engines.hf import HFEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    _, endpoint, record = serve(HFEngine(model, tokenizer), RunSampling(
        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=12, max_total_tokens=300))
    client = endpoint.openai()
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    first = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="policy", messages=messages)
    (sequence,) = record.sequences
    assert sum(sequence.mask) > 12 and record.requests == 2
    served = [entry.logprob for entry in first.choices[0].logprobs.content]
    assert served == [lp for lp, m in zip(sequence.logprobs, sequence.mask) if m][:len(served)]
    ids = torch.tensor([sequence.tokens])
    mask = torch.tensor([sequence.mask[1:]], dtype=torch.float32)  # (1, A): position t predicts token t+1
    with torch.no_grad():
        trainer, _ = token_logprobs(model, ids, torch.ones_like(ids), mask, temperature=1.0)
    at = mask[0].nonzero().squeeze(-1)
    recorded = torch.tensor(sequence.logprobs[1:])[at]
    assert torch.allclose(trainer[0, at], recorded, atol=1e-5), (trainer[0, at] - recorded).abs().max()


class StuckEngine:
    """Never finishes a request (an agent abandoned at its timeout may leave one in flight)."""

    shares_weights = True

    def __init__(self, tokenizer):
        import threading

        self.eos_ids = {tokenizer.eos_token_id}
        self.started, self.cancelled = threading.Event(), threading.Event()

    async def generate_one(self, prompt_ids, params):
        import asyncio

        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_closing_a_trajectory_ends_its_generation_in_flight(tokenizer, serve):
    import threading

    engine = StuckEngine(tokenizer)
    trajectory, endpoint, record = serve(engine)
    answers = []

    def request():
        try:
            answers.append(post(f"{endpoint.base_url}/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
                                endpoint.api_key))
        except Exception as exc:  # noqa: BLE001 - the connection may simply close
            answers.append(exc)

    caller = threading.Thread(target=request, daemon=True)
    caller.start()
    assert engine.started.wait(30)
    serve.server.close(trajectory)  # returns only once nothing of the trajectory is generating
    assert engine.cancelled.is_set() and record.sequences == []
    caller.join(30)
    status, _ = post(f"{endpoint.base_url}/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
                     endpoint.api_key)
    assert status == 404  # the trajectory's path serves nothing any more


def test_a_conversation_the_template_cannot_render_is_a_400_and_changes_nothing(tokenizer, serve):
    engine = ScriptedEngine(tokenizer, ["Hello<|im_end|>", "Bye<|im_end|>"])
    _, endpoint, record = serve(engine)
    messages = [{"role": "user", "content": "Hi"}]
    status, first = post(f"{endpoint.base_url}/chat/completions", {"messages": messages}, endpoint.api_key)
    reply = first["choices"][0]["message"]
    broken = messages + [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]},
                         {"role": "user", "content": "More"}]
    status, answer = post(f"{endpoint.base_url}/chat/completions", {"messages": broken}, endpoint.api_key)
    assert status == 400 and answer["error"]["code"] == "template_error"
    status, _ = post(f"{endpoint.base_url}/chat/completions",
                     {"messages": messages + [reply, {"role": "user", "content": "More"}]}, endpoint.api_key)
    (sequence,) = record.sequences  # the valid follow-up still extends the first request's sequence
    assert status == 200 and sum(sequence.mask) == sum(map(len, engine.sampled))
