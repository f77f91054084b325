"""Token-exact recording (rlhf.runtime.agents.recording), with the tiny tokenizer and scripted
completions: a chain of requests is one sequence whose model tokens are exactly the sampled ones and
whose every request starts with the tokens recorded before it, whatever the template does to earlier
turns; an edited history starts a new segment; a request from an earlier point branches."""

from __future__ import annotations

import pytest

from rlhf.plugin_kit.tiny_model import build_tokenizer
from rlhf.plugins.tool_parsers.hermes import parse
from rlhf.runtime.agents.recording import TrajectoryRecord
from rlhf.runtime.agents.template import ChatTemplate
from tests.agents.templates import FAITHFUL, REWRITING

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<think>I should add.</think>\n<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'


@pytest.fixture(scope="module")
def base_tokenizer():
    return build_tokenizer()


def tokenizer_with(base, template):
    tokenizer = base.__class__(tokenizer_object=base.backend_tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                               pad_token="<|pad|>", padding_side="left")
    tokenizer.chat_template = template
    return tokenizer


class Agent:
    """Sends requests to a record and answers them from a script, as the endpoint would."""

    def __init__(self, tokenizer, template):
        self.tokenizer = tokenizer_with(tokenizer, template)
        self.record = TrajectoryRecord(ChatTemplate(self.tokenizer))
        self.sent: list[list[int]] = []  # what the policy was asked to continue
        self.sampled: list[list[int]] = []  # what it sampled

    def ask(self, messages, text, tools=None, *, record=True):
        prompt = self.record.chat_prompt(messages, tools)
        ids = self.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]  # the model ends its turn
        self.sent.append(list(prompt.ids))
        self.sampled.append(ids)
        turn = parse(text) if tools else None
        reply = {"role": "assistant", "content": text if turn is None else turn.content,
                 **({"tool_calls": turn.tool_calls} if turn is not None and turn.tool_calls else {})}
        if record:
            self.record.record(prompt, ids, [-0.25] * len(ids), reply, "stop")
        return reply, prompt


def model_tokens(sequence):
    return [t for t, m in zip(sequence.tokens, sequence.mask) if m]


def test_a_faithful_template_extends_the_recorded_tokens_exactly(base_tokenizer):
    agent = Agent(base_tokenizer, FAITHFUL)
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    reply, _ = agent.ask(messages, "I will add")
    messages += [reply, {"role": "tool", "content": "3"}]
    reply, _ = agent.ask(messages, "The answer is 3.")
    (sequence,) = agent.record.sequences
    assert agent.sent[1][:len(agent.sent[0]) + len(agent.sampled[0])] == agent.sent[0] + agent.sampled[0]
    assert model_tokens(sequence) == agent.sampled[0] + agent.sampled[1]
    assert [lp for lp, m in zip(sequence.logprobs, sequence.mask) if m] == [-0.25] * sum(map(len, agent.sampled))
    assert all(lp == 0.0 for lp, m in zip(sequence.logprobs, sequence.mask) if not m)
    assert agent.record.drift == 0 and agent.record.follow_ups == 1
    # the rendering of the new messages follows the model's end-of-turn token as the template writes it
    between = sequence.tokens[len(agent.sent[0]) + len(agent.sampled[0]):len(agent.sent[1])]
    assert agent.tokenizer.decode(between) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_keeps_the_model_tokens(base_tokenizer):
    agent = Agent(base_tokenizer, REWRITING)
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    reply, _ = agent.ask(messages, CALL, TOOLS)
    assert reply["tool_calls"][0]["function"]["name"] == "add"
    rendered = agent.record.template.text(messages + [reply], TOOLS, generation_prompt=False)
    assert "<think>" not in rendered and '"a": 1' in rendered  # the template would not give back the model's text
    messages += [reply, {"role": "tool", "content": "3"}]
    reply, _ = agent.ask(messages, "The answer is 3.", TOOLS)
    messages += [reply, {"role": "user", "content": "And 2 + 2?"}]
    agent.ask(messages, "4", TOOLS)
    (sequence,) = agent.record.sequences
    for before, after in ((0, 1), (1, 2)):  # every request starts with everything recorded before it
        assert agent.sent[after][:len(agent.sent[before]) + len(agent.sampled[before])] == \
            agent.sent[before] + agent.sampled[before]
    assert model_tokens(sequence) == [t for ids in agent.sampled for t in ids]
    # both follow-ups were spliced: the template rewrites the first turn every time it renders it
    assert agent.record.drift == 2 and agent.record.follow_ups == 2
    between = sequence.tokens[len(agent.sent[0]) + len(agent.sampled[0]):len(agent.sent[1])]
    assert agent.tokenizer.decode(between) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"


def test_an_edited_history_starts_a_second_segment(base_tokenizer):
    agent = Agent(base_tokenizer, FAITHFUL)
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    reply, _ = agent.ask(messages, "Let me think")
    messages += [reply, {"role": "tool", "content": "3"}]
    agent.ask(messages, "It is 3")
    summary = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "(summary) 3"},
               {"role": "user", "content": "Sure?"}]
    agent.ask(summary, "Yes")
    first, second = agent.record.trained_sequences()
    assert model_tokens(first) == agent.sampled[0] + agent.sampled[1]
    assert model_tokens(second) == agent.sampled[2]
    assert second.tokens[:len(agent.sent[2])] == agent.sent[2] and not any(second.mask[:len(agent.sent[2])])
    assert agent.tokenizer.decode(agent.sent[2]).count("(summary) 3") == 1  # the edit is template text, mask 0


def test_a_request_from_an_earlier_turn_branches_with_the_shared_tokens_masked(base_tokenizer):
    agent = Agent(base_tokenizer, FAITHFUL)
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    reply, _ = agent.ask(messages, "Let me think")
    agent.ask(messages + [reply, {"role": "tool", "content": "3"}], "It is 3")
    agent.ask(messages + [reply, {"role": "tool", "content": "4"}], "It is 4")  # retried with another tool result
    first, branch = agent.record.trained_sequences()
    shared = len(agent.sent[0]) + len(agent.sampled[0])
    assert branch.tokens[:shared] == first.tokens[:shared] and not any(branch.mask[:shared])
    assert model_tokens(branch) == agent.sampled[2]


def test_overlapping_requests_on_one_turn_branch(base_tokenizer):
    agent = Agent(base_tokenizer, FAITHFUL)
    messages = [{"role": "user", "content": "Hi"}]
    reply, _ = agent.ask(messages, "Hello")
    follow = messages + [reply, {"role": "user", "content": "Again"}]
    _, first = agent.ask(follow, "One", record=False)  # still generating when the second arrives
    _, second = agent.ask(follow, "Two", record=False)
    assert first.sequence is not second.sequence and first.ids == second.ids


def test_a_refused_request_leaves_the_sequence_as_it_was(base_tokenizer):
    agent = Agent(base_tokenizer, FAITHFUL)
    messages = [{"role": "user", "content": "Hi"}]
    reply, _ = agent.ask(messages, "Hello")
    (sequence,) = agent.record.sequences
    recorded = list(sequence.tokens)
    _, prompt = agent.ask(messages + [reply, {"role": "user", "content": "More"}], "x", record=False)
    agent.record.abandon(prompt)
    assert sequence.tokens == recorded and len(sequence.mask) == len(sequence.logprobs) == len(recorded)
    agent.ask(messages + [reply, {"role": "user", "content": "More"}], "Sure")
    assert len(agent.record.sequences) == 1  # the next request extends it again


def test_token_prompts_extend_by_token_prefix(base_tokenizer):
    agent = Agent(base_tokenizer, FAITHFUL)
    record = agent.record
    first = record.token_prompt([5, 6, 7])
    record.record(first, [8, 9], [-1.0, -1.0], None, "stop")
    extended = record.token_prompt([5, 6, 7, 8, 9, 10])
    record.record(extended, [11], [-1.0], None, "stop")
    other = record.token_prompt([5, 6, 99])
    record.record(other, [12], [-1.0], None, "stop")
    first_sequence, new = record.trained_sequences()
    assert first_sequence.tokens == [5, 6, 7, 8, 9, 10, 11] and first_sequence.mask == [0, 0, 0, 1, 1, 0, 1]
    assert new.tokens == [5, 6, 99, 12] and new.mask == [0, 0, 0, 1]


def test_every_token_says_where_it_came_from(base_tokenizer):
    agent = Agent(base_tokenizer, REWRITING)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]
    reply, _ = agent.ask(messages, CALL, TOOLS)
    messages += [reply, {"role": "tool", "content": "3"}]
    agent.ask(messages, "It is 3.", TOOLS)
    (sequence,) = agent.record.sequences
    assert len(sequence.origins) == len(sequence.tokens)
    assert [o == "model" for o in sequence.origins] == [bool(m) for m in sequence.mask]

    def text_of(origin):
        return agent.tokenizer.decode([t for t, o in zip(sequence.tokens, sequence.origins) if o == origin])

    assert text_of("system") == "Be brief." and text_of("user") == "What is 1 + 2?" and text_of("tool") == "3"
    assert "<|im_start|>assistant" in text_of("template") and "Tools:" in text_of("template")


def test_a_branch_marks_the_model_tokens_it_shares(base_tokenizer):
    agent = Agent(base_tokenizer, FAITHFUL)
    messages = [{"role": "user", "content": "Hi"}]
    reply, _ = agent.ask(messages, "Hello")
    agent.ask(messages + [reply, {"role": "user", "content": "A"}], "One")
    agent.ask(messages + [reply, {"role": "user", "content": "B"}], "Two")
    first, branch = agent.record.sequences
    shared = len(agent.sent[0]) + len(agent.sampled[0])
    assert branch.origins[:shared] == ["shared" if o == "model" else o for o in first.origins[:shared]]
    assert "shared" in branch.origins and branch.origins.count("model") == len(agent.sampled[2])
