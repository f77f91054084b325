"""Continuous batching in the ``hf`` engine (rlhf/plugins/engines/hf_continuous.py) and the rollout's
trajectories moving on their own with it: requests join and leave one decode batch, a trajectory's
next turn starts while another's tool call is still out, and what a request samples depends on
its seed, not on its neighbours."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from tests.helpers import EnvsOf, GatedTools, RewardingEnv, assert_engine_logprobs_are_the_trainers, prompt_item
from rlhf.core.protocols.rollout import SamplingParams, batches_continuously
from rlhf.core.types import StepResult
from rlhf.plugins.engines.config import HFEngineConfig
from rlhf.plugins.engines.hf import HFEngine
from rlhf.plugins.engines.hf_continuous import DecodeBatch
from rlhf.plugins.engines.sampling import inverse_cdf
from rlhf.runtime.rl.rollout import RolloutSettings, RolloutWorker, request_seed


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def _prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in ("What is 12 + 7?", "hi", "Say many a's please, then stop")]


def _never_ends(engine):
    """No token is EOS: every request runs to its budget (turns that end by EOS would end episodes)."""
    engine.eos_ids = {10 ** 6}
    return engine


async def _staggered(engine, requests, delays):
    async def one(prompt, params, delay):
        await asyncio.sleep(delay)
        return await engine.generate_one(prompt, params)

    return await asyncio.gather(*(one(p, params, d) for (p, params), d in zip(requests, delays)))


def _record_batch_sizes(monkeypatch):
    sizes = []
    step = DecodeBatch._step

    def recording(self):
        sizes.append(len(self.rows))
        step(self)

    monkeypatch.setattr(DecodeBatch, "_step", recording)
    return sizes


@pytest.mark.run
def test_staggered_greedy_requests_get_what_one_batched_generate_gives(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    engine = _never_ends(HFEngine(model, tokenizer))
    prompts = _prompts(tokenizer)
    sizes = _record_batch_sizes(monkeypatch)
    budgets = [12, 5, 9]  # rows leave at different steps
    got = asyncio.run(_staggered(engine, [(p, SamplingParams(max_new_tokens=b, temperature=0.0, return_logprobs=True))
                                          for p, b in zip(prompts, budgets)], [0.0, 0.0, 0.0]))
    for prompt, budget, generation in zip(prompts, budgets, got):
        [expected] = engine.generate([prompt], n=1, params=SamplingParams(max_new_tokens=budget, temperature=0.0,
                                                                          return_logprobs=True))
        assert generation.token_ids == expected.token_ids and generation.finish_reason == "length"
        assert generation.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert sizes[0] == 3 and sizes[-1] == 1 and 3 - 1 in sizes  # all three decode together, then leave one by one


@pytest.mark.run
def test_a_request_joins_the_running_batch_and_leaves_it_when_done(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    engine = _never_ends(HFEngine(model, tokenizer))
    prompts = _prompts(tokenizer)
    sizes = _record_batch_sizes(monkeypatch)

    async def scenario():
        batch_done = asyncio.Event()
        long = asyncio.ensure_future(engine.generate_one(prompts[0], SamplingParams(max_new_tokens=30,
                                                                                   temperature=0.0)))
        while not sizes:  # the first request decodes alone
            await asyncio.sleep(0)
        late = await engine.generate_one(prompts[1], SamplingParams(max_new_tokens=4, temperature=0.0))
        batch_done.set()
        assert not long.done()  # the late request finished while the first was still decoding
        return await long, late

    long, late = asyncio.run(scenario())
    assert len(long.token_ids) == 30 and len(late.token_ids) == 4
    assert sizes[0] == 1 and sizes.count(2) == 4 and sizes[-1] == 1  # joined for its 4 steps, then left
    [alone] = engine.generate([prompts[1]], n=1, params=SamplingParams(max_new_tokens=4, temperature=0.0))
    assert late.token_ids == alone.token_ids  # prompts of other lengths in the batch change nothing


@pytest.mark.run
def test_what_a_seeded_request_samples_does_not_depend_on_its_neighbours(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = _never_ends(HFEngine(model, tokenizer))
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, return_logprobs=True, seed=1234)
    [alone] = asyncio.run(_staggered(engine, [(prompts[2], params)], [0.0]))
    neighbours = [(prompts[0], SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)),
                  (prompts[2], params),
                  (prompts[1], SamplingParams(max_new_tokens=20, temperature=0.7, top_k=5, seed=2))]
    mixed = asyncio.run(_staggered(engine, neighbours, [0.0, 0.002, 0.0]))[1]
    assert mixed.token_ids == alone.token_ids
    assert mixed.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    [other_seed] = asyncio.run(_staggered(engine, [(prompts[2], SamplingParams(max_new_tokens=16, temperature=1.0,
                                                                                seed=99))], [0.0]))
    assert other_seed.token_ids != alone.token_ids


@pytest.mark.run
@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9),
                                      dict(temperature=1.0, top_k=7, repetition_penalty=1.3)])
def test_log_probs_are_those_of_the_distribution_sampled(model_and_tokenizer, settings):
    """At top_p = top_k = 1 and no penalty they are the trainer's; with them, the processed
    distribution's, exactly as the turn-batched decoder reports them."""
    model, tokenizer = model_and_tokenizer
    engine = _never_ends(HFEngine(model, tokenizer))
    prompts = _prompts(tokenizer)
    params = [SamplingParams(max_new_tokens=10, return_logprobs=True, seed=7 + i, **settings) for i in range(3)]
    got = asyncio.run(_staggered(engine, list(zip(prompts, params)), [0.0, 0.001, 0.0]))
    if set(settings) == {"temperature"}:
        assert_engine_logprobs_are_the_trainers(model, tokenizer, prompts, got, temperature=settings["temperature"])
    for prompt, generation, request in zip(prompts, got, params):
        assert len(generation.token_ids) == 10 and all(lp <= 0 for lp in generation.logprobs)
        # replay the request's tokens through the forward and the same processing
        ids = torch.tensor([prompt + generation.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()  # (N, V)
        seen = torch.zeros((1, logits.shape[-1]), dtype=torch.bool)
        seen[0, prompt] = True
        for t, token in enumerate(generation.token_ids):
            scores = engine._process(logits[t:t + 1], request, seen if request.repetition_penalty != 1.0 else None)
            expected = torch.log_softmax(scores, dim=-1)[0, token].item()
            assert generation.logprobs[t] == pytest.approx(expected, abs=1e-4)
            seen[0, token] = True


@pytest.mark.run
def test_stop_strings_end_a_request_as_the_generate_decoder_ends_it(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = _never_ends(HFEngine(model, tokenizer))
    prompts = _prompts(tokenizer)
    [free] = engine.generate([prompts[0]], n=1, params=SamplingParams(max_new_tokens=24, temperature=0.0))
    text = tokenizer.decode(free.token_ids)
    stop = text[len(text) // 2: len(text) // 2 + 2]  # a string the greedy continuation contains
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop=(stop,), return_logprobs=True)
    [got] = asyncio.run(_staggered(engine, [(prompts[0], params)], [0.0]))
    [expected] = HFEngine(model, tokenizer, HFEngineConfig(decoder="generate")).generate([prompts[0]], n=1,
                                                                                          params=params)
    assert got.token_ids == expected.token_ids and got.stop_string == expected.stop_string == stop
    assert got.finish_reason == "stop" and stop in tokenizer.decode(got.token_ids)
    assert len(got.logprobs) == len(got.token_ids)


@pytest.mark.run
def test_eos_ends_a_request_with_the_eos_token_kept(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = _never_ends(HFEngine(model, tokenizer))
    prompts = _prompts(tokenizer)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    free = asyncio.run(_staggered(engine, [(p, greedy) for p in prompts], [0.0] * 3))
    engine.eos_ids = {free[0].token_ids[3]}  # the first prompt's fourth token now ends it
    got = asyncio.run(_staggered(engine, [(p, greedy) for p in prompts], [0.0] * 3))
    for before, after in zip(free, got):
        end = next((i for i, token in enumerate(before.token_ids) if token in engine.eos_ids), None)
        if end is None:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"
        else:
            assert after.token_ids == before.token_ids[:end + 1] and after.finish_reason == "stop"
    assert got[0].token_ids == free[0].token_ids[:got[0].token_ids.index(free[0].token_ids[3]) + 1]


@pytest.mark.run
def test_generation_batch_size_caps_the_rows_decoding_at_once(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    engine = _never_ends(HFEngine(model, tokenizer, HFEngineConfig(generation_batch_size=2)))
    sizes = _record_batch_sizes(monkeypatch)
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    got = asyncio.run(_staggered(engine, [(p, params) for p in _prompts(tokenizer)] * 2, [0.0] * 6))
    assert max(sizes) == 2 and len(got) == 6 and all(len(g.token_ids) == 3 for g in got)


@pytest.mark.run
def test_a_failing_forward_fails_every_request_in_flight(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    engine = _never_ends(HFEngine(model, tokenizer))

    def broken(self):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(DecodeBatch, "_step", broken)
    params = SamplingParams(max_new_tokens=3, temperature=0.0)

    async def scenario():
        return await asyncio.gather(*(engine.generate_one(p, params) for p in _prompts(tokenizer)),
                                    return_exceptions=True)

    assert [str(r) for r in asyncio.run(scenario())] == ["out of memory"] * 3


@pytest.mark.run
def test_a_model_with_learned_positions_decodes_left_padded_prompts_as_generate_does(model_and_tokenizer):
    """GPT-2's position embeddings are a table: the left padding of prompts of different lengths
    must not ask it for position -1."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=2,
                                       n_head=2)).eval()
    engine = _never_ends(HFEngine(model, tokenizer))
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def scenario():
        return await asyncio.wait_for(asyncio.gather(*(engine.generate_one(p, params) for p in prompts)), timeout=20)

    for prompt, generation in zip(prompts, asyncio.run(scenario())):
        [expected] = engine.generate([prompt], n=1, params=params)
        assert generation.token_ids == expected.token_ids and len(generation.token_ids) == 6


@pytest.mark.run
def test_a_failing_prefill_fails_the_requests_joining_and_those_in_flight(model_and_tokenizer, monkeypatch):
    """A request whose prefill raises (here the second to join, while the first decodes) gets the
    error, as do the rows already decoding: none waits forever."""
    model, tokenizer = model_and_tokenizer
    engine = _never_ends(HFEngine(model, tokenizer))
    admit, admitted = DecodeBatch._admit, []

    def failing_second(self, joining):
        admitted.append(len(joining))
        if len(admitted) == 2:
            raise RuntimeError("prefill failed")
        admit(self, joining)

    monkeypatch.setattr(DecodeBatch, "_admit", failing_second)
    first, later = _prompts(tokenizer)[:2]

    async def scenario():
        return await asyncio.wait_for(asyncio.gather(
            engine.generate_one(first, SamplingParams(max_new_tokens=50, temperature=0.0)),
            _staggered(engine, [(later, SamplingParams(max_new_tokens=3, temperature=0.0))], [0.01]),
            return_exceptions=True), timeout=20)

    results = asyncio.run(scenario())
    assert admitted == [1, 1]
    assert [str(r) for r in results] == ["prefill failed"] * 2


@pytest.mark.unit
def test_which_rollouts_batch_continuously(tiny_model_dir, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_new_tokens=4)
    # the hf engine is registered with continuous_batching=True; its continuous_for decides per rollout
    assert batches_continuously(HFEngine(model, tokenizer), params, declared=True)
    assert not batches_continuously(HFEngine(model, tokenizer, HFEngineConfig(continuous=False)), params, declared=True)
    assert not batches_continuously(HFEngine(model, tokenizer, HFEngineConfig(decoder="generate")), params,
                                    declared=True)
    from transformers import MistralConfig, MistralForCausalLM

    windowed = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                sliding_window=16, layer_types=["sliding_attention"]))
    assert not batches_continuously(HFEngine(windowed, tokenizer), params, declared=True)
    # an engine whose registration does not declare it batches turn by turn, whatever methods it has
    assert not batches_continuously(HFEngine(model, tokenizer), params, declared=False)


@pytest.mark.unit
def test_inverse_cdf_picks_the_interval_each_uniform_falls_in():
    probs = torch.tensor([[0.25, 0.0, 0.5, 0.25], [0.0, 0.0, 0.0, 1.0]])  # (2, 4)
    cases = {0.0: [0, 3], 0.2499: [0, 3], 0.25: [2, 3], 0.7499: [2, 3], 0.75: [3, 3], 0.999999: [3, 3]}
    for u, expected in cases.items():
        assert inverse_cdf(probs, torch.full((2, 1), u)).tolist() == expected


# --- the rollout: trajectories move on their own ---------------------------------------------------

@pytest.mark.run
def test_a_trajectory_whose_tool_returns_generates_its_next_turn_while_another_waits(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    GatedTools.clear()
    worker = RolloutWorker(_never_ends(HFEngine(model, tokenizer)), tokenizer, EnvsOf(GatedTools),
                           RolloutSettings(env="tools", max_turns=3, max_total_tokens=256),
                           continuous_batching=True)
    trajectories = worker.generate([prompt_item(tokenizer, "Q: 6*7?", "fast"), prompt_item(tokenizer, "Q: 7*6?", "slow")], n=1,
                                   params=SamplingParams(max_new_tokens=4, temperature=1.0))
    assert GatedTools.opened == [True]
    assert [t.num_turns for t in trajectories] == [3, 3]
    assert [t.info["env_reward"] for t in trajectories] == [6.0, 6.0]


class Echo:
    """An observation after each of two turns, then done."""

    def reset(self, prompt, label):
        self.turns = 0
        return " [start]"

    def step(self, action):
        self.turns += 1
        return StepResult(observation=f" [tool {self.turns}]", reward=0.5, done=self.turns >= 2)


@pytest.mark.run
def test_continuous_rollouts_lay_out_trajectories_as_turn_batched_ones(model_and_tokenizer):
    """Greedy: the same tokens, masks, turns and finish reasons either way (sampling differs: the
    continuous rollout draws from per-request streams)."""
    model, tokenizer = model_and_tokenizer
    items = [prompt_item(tokenizer, "Q: 6*7?", "a"), prompt_item(tokenizer, "Say many a's", "b")]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, return_logprobs=True)
    runs = []
    for continuous in (True, False):
        engine = HFEngine(model, tokenizer, HFEngineConfig(continuous=continuous))
        worker = RolloutWorker(engine, tokenizer, EnvsOf(Echo), RolloutSettings(env="tools", max_turns=3,
                                                                               max_total_tokens=40),
                               continuous_batching=True)
        runs.append(worker.generate(items, n=2, params=params))
    for got, expected in zip(*runs):
        assert (got.token_ids, got.loss_mask, got.num_turns, got.finish_reason) == \
            (expected.token_ids, expected.loss_mask, expected.num_turns, expected.finish_reason)
        assert got.rollout_logprobs == pytest.approx(expected.rollout_logprobs, abs=1e-5)
        assert got.info["env_reward"] == expected.info["env_reward"]


@pytest.mark.unit
def test_request_seeds_differ_by_trajectory_and_turn_and_repeat_for_the_same_rollout_seed():
    seeds = {request_seed(5, trajectory, turn) for trajectory in range(50) for turn in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2 ** 63 for s in seeds)
    assert request_seed(5, 3, 1) == request_seed(5, 3, 1) != request_seed(6, 3, 1)


@pytest.mark.run
def test_a_failing_environment_names_itself_and_the_other_trajectories_go_on(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer

    class Broken(Echo):
        def step(self, action):
            if self.turns == 0 and "7*6" in self.prompt:
                raise ValueError("tool crashed")
            return super().step(action)

        def reset(self, prompt, label):
            self.prompt = prompt
            return super().reset(prompt, label)

    worker = RolloutWorker(_never_ends(HFEngine(model, tokenizer)), tokenizer, EnvsOf(Broken),
                           RolloutSettings(env="tools", max_turns=3, max_total_tokens=64),
                           continuous_batching=True)
    items = [prompt_item(tokenizer, "Q: 6*7?", "fast"), prompt_item(tokenizer, "Q: 7*6?", "slow")]
    trajectories = worker.generate(items, n=2, params=SamplingParams(max_new_tokens=4, temperature=1.0))
    assert [t.outcome for t in trajectories[2:]] == ["env_error", "env_error"]  # the failing ones end there
    for trajectory in trajectories[2:]:
        assert re.fullmatch(r"environment 'tools' failed on row slow: ValueError: tool crashed", trajectory.error)
        assert trajectory.num_turns == 1
    assert all(t.outcome in ("ok", "truncated") and t.error is None for t in trajectories[:2])


@pytest.mark.run
def test_single_turn_rollouts_stay_one_batched_generate(model_and_tokenizer, monkeypatch):
    """A single-turn environment (however large --max-turns) and --max-turns 1 keep the turn-batched
    decoders (the lean step, the process's random stream): continuous batching only pays between turns."""
    model, tokenizer = model_and_tokenizer
    items = [prompt_item(tokenizer, "Q: 6*7?", "a"), prompt_item(tokenizer, "Say many a's", "b")]
    calls = []
    monkeypatch.setattr(HFEngine, "generate_one", lambda self, *a, **k: calls.append("one"))
    for envs, turns in ((EnvsOf(RewardingEnv, multi_turn=False), 8), (EnvsOf(RewardingEnv), 1)):
        worker = RolloutWorker(HFEngine(model, tokenizer), tokenizer, envs,
                               RolloutSettings(env="tools", max_turns=turns, max_total_tokens=64),
                               continuous_batching=True)
        trajectories = worker.generate(items, n=2, params=SamplingParams(max_new_tokens=4, temperature=1.0))
        assert len(trajectories) == 4 and calls == []
