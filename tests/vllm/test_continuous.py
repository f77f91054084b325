"""``VLLMEngine.generate_one`` (continuous batching) against the fake vLLM engine (tests/vllm/fakes.py):
the same completions as ``generate``, requests joining and leaving between steps, seeds, errors and
cancellation aborting requests, and sleep/wake and weight pushes with requests in flight."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlhf.core.protocols.rollout import Generation, SamplingParams, batches_continuously
from tests.helpers import EnvsOf, GatedTools, prompt_item
from tests.vllm import fakes
from tests.vllm.fakes import make_engine

pytestmark = pytest.mark.unit

PARAMS = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.95, return_logprobs=True)


def length_script(prompt, sampling):
    """``prompt[-1]`` tokens (10, 11, ..., then EOS), so a prompt says how many steps it decodes for;
    a stop string, when asked for, ends a prompt that starts with 0 instead of EOS."""
    eos = sampling["stop_token_ids"][0]
    ids = [10 + i for i in range(prompt[-1] - 1)]
    if sampling["stop"] and prompt[0] == 0:
        return fakes.Completion(token_ids=ids + [99], finish_reason="stop", stop_reason=sampling["stop"][0],
                                logprobs=[{t: fakes.Logprob(-0.5)} for t in ids + [99]])
    ids.append(eos)
    logprobs = [{t: fakes.Logprob(-0.125 * (i + 1))} for i, t in enumerate(ids)] if sampling["logprobs"] == 0 else None
    return fakes.Completion(token_ids=ids, finish_reason="stop", logprobs=logprobs)


@pytest.mark.parametrize("internal_ids", [False, True])
def test_generate_one_returns_what_generate_returns(fake_vllm, policy, internal_ids):
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(length_script)
    llm.llm_engine.internal_ids = internal_ids
    prompts = [[5, 3], [8, 1], [6, 5], [0, 4]]  # the last ends at a stop string
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.95, stop=("</call>",), return_logprobs=True)
    batched = engine.generate(prompts, n=1, params=params)

    async def rollout():
        return await asyncio.gather(*(engine.generate_one(p, params) for p in prompts))

    continuous = asyncio.run(rollout())
    assert continuous == batched
    assert continuous[3] == Generation(token_ids=[10, 11, 12, 99], finish_reason="stop", stop_string="</call>",
                                       logprobs=[-0.5] * 4)
    assert continuous[0].token_ids == [10, 11, policy[1].eos_token_id] and continuous[0].logprobs == [-0.125, -0.25,
                                                                                                     -0.375]
    for rid in llm.llm_engine.added:  # the same vLLM sampling arguments, and a final output only
        kwargs = dict(llm.llm_engine.sampling[rid].kwargs)
        assert kwargs.pop("output_kind") is fakes.RequestOutputKind.FINAL_ONLY and kwargs.pop("seed") is None
        assert kwargs == llm.sampling.kwargs
    r0, r1, r2, r3 = llm.llm_engine.added  # 3, 1, 5 and 4 tokens: each leaves at the step of its last
    assert llm.llm_engine.batches == [[r0, r1, r2, r3], [r0, r2, r3], [r0, r2, r3], [r2, r3], [r2]]
    assert not llm.llm_engine.running and batches_continuously(engine, params, declared=True)


def test_requests_join_and_leave_between_steps(fake_vllm, policy):
    """A request asked for while others decode joins at the next step; one that ends leaves at its
    last step, and its trajectory's next turn joins at once without waiting for the others."""
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(length_script)
    steps = llm.llm_engine.batches
    turns = []

    async def trajectory(name, first, second):  # two turns: the second is asked for when the first ends
        turns.append((name, len(steps)))
        await engine.generate_one([first], PARAMS)
        turns.append((name, len(steps)))
        await engine.generate_one([second], PARAMS)

    async def late(after_steps):
        while len(steps) < after_steps:
            await asyncio.sleep(0)
        turns.append(("late", len(steps)))
        await engine.generate_one([2], PARAMS)

    async def rollout():
        await asyncio.gather(trajectory("a", 2, 3), trajectory("b", 6, 1), late(3))

    asyncio.run(rollout())
    a1, b1, a2, c, b2 = [f"rlhf-{i}" for i in range(5)]  # ids in the order the requests were made
    assert turns == [("a", 0), ("b", 0), ("a", 2), ("late", 3), ("b", 6)]
    assert steps == [sorted(batch) for batch in ([a1, b1], [a1, b1],  # a's first turn ends at step 2 ...
                                                 [a2, b1],  # ... and its second joins at step 3;
                                                 [a2, b1, c],  # c, asked for after step 3, joins at 4
                                                 [a2, b1, c], [b1], [b2])]
    assert llm.llm_engine.added == [a1, b1, a2, c, b2] and not llm.llm_engine.running


def test_seeds_reach_vllm_and_request_ids_stay_unique(fake_vllm, policy):
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    seeds = [7, None, 2**40]

    async def rollout():
        return await asyncio.gather(*(engine.generate_one([5], SamplingParams(max_new_tokens=4, seed=s))
                                      for s in seeds))

    asyncio.run(rollout())
    asyncio.run(rollout())  # a new event loop, as each rollout call makes
    added = llm.llm_engine.added
    assert [llm.llm_engine.sampling[rid].kwargs["seed"] for rid in added] == seeds * 2
    assert len(set(added)) == 6


def test_a_failed_step_reaches_every_waiting_request_and_aborts_them(fake_vllm, policy):
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(length_script)
    llm.llm_engine.fail_at_step = 2

    async def rollout():
        return await asyncio.gather(engine.generate_one([1], PARAMS), engine.generate_one([4], PARAMS),
                                    engine.generate_one([5], PARAMS), return_exceptions=True)

    first, second, third = asyncio.run(rollout())
    assert first.token_ids == [policy[1].eos_token_id]  # ended at step 1, before the failure
    assert isinstance(second, RuntimeError) and "illegal memory access" in str(second) and third is second
    assert llm.llm_engine.aborted == ["rlhf-1", "rlhf-2"] and not llm.llm_engine.running

    llm.llm_engine.fail_at_step = None  # the engine serves the next rollout
    assert asyncio.run(engine.generate_one([2], PARAMS)).finish_reason == "stop"


def test_a_request_vllm_refuses_fails_alone(fake_vllm, policy):
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(length_script)

    async def rollout():
        good = asyncio.ensure_future(engine.generate_one([3], PARAMS))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="prompt cannot be empty"):
            await engine.generate_one([], PARAMS)
        return await good

    assert len(asyncio.run(rollout()).token_ids) == 3
    assert not llm.llm_engine.aborted and not llm.llm_engine.running


def test_cancelling_a_request_aborts_it_in_vllm(fake_vllm, policy):
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(length_script)
    steps = llm.llm_engine.batches

    async def rollout():
        doomed = asyncio.ensure_future(engine.generate_one([50], PARAMS))
        other = asyncio.ensure_future(engine.generate_one([8], PARAMS))
        while len(steps) < 2:
            await asyncio.sleep(0)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert llm.llm_engine.aborted == ["rlhf-0"]
        return await other

    assert len(asyncio.run(rollout()).token_ids) == 8 and not llm.llm_engine.running
    # cancelled after step 2: the step already queued may still decode it, none after that
    assert steps == [["rlhf-0", "rlhf-1"]] * 3 + [["rlhf-1"]] * 5


def test_a_closing_event_loop_leaves_nothing_in_vllm(fake_vllm, policy):
    """``asyncio.run`` cancels the requests its main coroutine left behind: each is aborted."""
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(length_script)

    async def rollout():
        for _ in range(3):
            asyncio.ensure_future(engine.generate_one([50], PARAMS))
        while len(llm.llm_engine.batches) < 2:
            await asyncio.sleep(0)

    asyncio.run(rollout())
    assert sorted(llm.llm_engine.aborted) == ["rlhf-0", "rlhf-1", "rlhf-2"] and not llm.llm_engine.running
    assert engine._batch.in_flight == 0


def test_auto_sleep_waits_for_the_last_request_in_flight(fake_vllm, policy):
    engine = make_engine(policy, enable_sleep_mode=True, auto_sleep=True, sleep_level=1)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(length_script)
    engine.load_weights(None)
    engine.sleep()
    del llm.calls[:]

    async def trajectory(first, second):
        await engine.generate_one([first], PARAMS)
        await engine.generate_one([second], PARAMS)

    async def rollout():
        await asyncio.gather(trajectory(2, 2), trajectory(5, 1), engine.generate_one([3], PARAMS))

    asyncio.run(rollout())
    assert llm.calls == [("wake_up", None), "add_request", "add_request", "add_request", "step", "add_request",
                         "step", "add_request", "step", ("sleep", 1)]
    assert llm.llm_engine.batches[-1] == ["rlhf-4"]  # the sleep came after the last request's last step

    asyncio.run(engine.generate_one([2], PARAMS))  # the next rollout wakes it again
    assert llm.calls[-4:] == [("wake_up", None), "add_request", "step", ("sleep", 1)]


def test_sleep_and_generate_are_refused_while_requests_are_in_flight(fake_vllm, policy):
    engine = make_engine(policy, enable_sleep_mode=True)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(length_script)

    async def rollout():
        task = asyncio.ensure_future(engine.generate_one([4], PARAMS))
        await asyncio.sleep(0)
        for call in (engine.sleep, lambda: engine.generate([[5]], n=1, params=PARAMS)):
            with pytest.raises(RuntimeError, match="1 generate_one requests are in flight"):
                call()
        return await task

    assert len(asyncio.run(rollout()).token_ids) == 4
    engine.sleep()  # nothing in flight any more


def test_new_weights_wait_for_the_requests_sampling_from_the_old(fake_vllm, policy):
    """A policy that changed while requests decode is pushed before the next request joins, once
    those have ended: no request mixes weights, and vLLM accepts the prefix-cache reset."""
    model = policy[0]
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(length_script)
    resets = []
    real_reset = llm.reset_prefix_cache
    llm.reset_prefix_cache = lambda: resets.append(real_reset()) or resets[-1]

    async def rollout():
        old = asyncio.ensure_future(engine.generate_one([3], PARAMS))
        while not llm.llm_engine.batches:
            await asyncio.sleep(0)
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)  # an optimizer step
        new = await engine.generate_one([2], PARAMS)
        return await old, new

    asyncio.run(rollout())
    assert llm.calls == ["collective_rpc", "reset_prefix_cache", "add_request", "step", "collective_rpc",
                         "reset_prefix_cache", "add_request", "step"]
    assert llm.llm_engine.batches == [["rlhf-0"]] * 3 + [["rlhf-1"]] * 2
    assert resets == [True, True]
    assert torch.equal(llm.worker.model.loaded["model.norm.weight"], model.model.norm.weight)


# --- through the rollout: multi-turn trajectories on the vllm engine --------------------------


def short_turns(prompt, sampling):
    """Three tokens, no EOS: the budget ends the turn and the environment decides when to stop."""
    return fakes.Completion(token_ids=[20, 21, 22], finish_reason="length")


def test_a_rollout_moves_each_trajectory_on_its_own(fake_vllm, policy):
    from rlhf.runtime.rl.rollout import RolloutSettings, RolloutWorker

    model, tokenizer = policy
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(short_turns)
    GatedTools.clear()
    worker = RolloutWorker(engine, tokenizer, EnvsOf(GatedTools), RolloutSettings(env="tools", max_turns=3,
                                                                                 max_total_tokens=256),
                           continuous_batching=True)
    trajectories = worker.generate([prompt_item(tokenizer, "Q: 6*7?", "fast"), prompt_item(tokenizer, "Q: 7*6?", "slow")], n=1,
                                   params=SamplingParams(max_new_tokens=3, temperature=1.0))
    assert GatedTools.opened == [True]
    assert [t.num_turns for t in trajectories] == [3, 3]
    assert [t.info["env_reward"] for t in trajectories] == [6.0, 6.0]
    seeds = [llm.llm_engine.sampling[rid].kwargs["seed"] for rid in llm.llm_engine.added]
    assert len(seeds) == 6 and len(set(seeds)) == 6 and all(isinstance(s, int) for s in seeds)
    assert not llm.llm_engine.running and "generate" not in llm.calls  # every turn went through generate_one


def test_continuous_false_turns_back_to_one_generate_per_turn(fake_vllm, policy):
    from rlhf.runtime.rl.rollout import RolloutSettings, RolloutWorker

    engine = make_engine(policy, continuous=False)
    llm = fakes.FakeLLM.instances[0]
    llm.script = staticmethod(short_turns)
    params = SamplingParams(max_new_tokens=3, temperature=1.0)
    assert not batches_continuously(engine, params, declared=True)
    worker = RolloutWorker(engine, policy[1], EnvsOf(Echo), RolloutSettings(env="tools", max_turns=3,
                                                                          max_total_tokens=256),
                           continuous_batching=True)
    trajectories = worker.generate([prompt_item(policy[1], "Q: 6*7?", "a"), prompt_item(policy[1], "Q: 7*6?", "b")], n=1,
                                   params=params)
    assert [t.num_turns for t in trajectories] == [2, 2]
    assert llm.calls.count("generate") == 2 and not llm.llm_engine.added  # one batched call per turn


class Echo:
    def reset(self, prompt, label):
        self.turns = 0
        return None

    def step(self, action):
        from rlhf.core.types import StepResult

        self.turns += 1
        return StepResult(observation=" ok.", reward=0.0, done=self.turns >= 2)


class Crashing:
    def reset(self, prompt, label):
        self.label = label
        return None

    def step(self, action):
        from rlhf.core.types import StepResult

        if self.label == "crash":  # a contract violation stops the rollout (a raise would be an env_error outcome)
            return "tool crashed"
        return StepResult(observation=" ok.", reward=0.0, done=False)


def test_a_failing_environment_aborts_the_other_trajectories_requests(fake_vllm, policy):
    from rlhf.runtime.rl.rollout import RolloutSettings, RolloutWorker

    model, tokenizer = policy
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    long_prompt = prompt_item(tokenizer, "Write a very long essay", "long")

    def script(prompt, sampling):  # the long trajectory's turn would take a million steps
        length = 10 ** 6 if prompt == long_prompt.prompt_ids else 1
        return fakes.Completion(token_ids=[20] * length, finish_reason="length")

    llm.script = staticmethod(script)
    worker = RolloutWorker(engine, tokenizer, EnvsOf(Crashing), RolloutSettings(env="tools", max_turns=3,
                                                                              max_total_tokens=64),
                           continuous_batching=True)
    with pytest.raises(Exception, match="tools.step must return rlhf.core.types.StepResult, got str"):
        worker.generate([prompt_item(tokenizer, "Q: 6*7?", "crash"), long_prompt], n=1,
                        params=SamplingParams(max_new_tokens=4, temperature=1.0))
    [long_request] = [rid for rid, ids in llm.llm_engine.prompts.items() if ids == long_prompt.prompt_ids]
    assert llm.llm_engine.aborted == [long_request] and not llm.llm_engine.running
    assert len(llm.llm_engine.batches) < 10 ** 6


def test_generate_one_reports_each_token_as_it_is_decoded_and_the_top_alternatives(fake_vllm, policy):
    """``on_token`` (streamed answers): the request asks vLLM for cumulative outputs and each new token
    is passed on after the step that decoded it; ``top_logprobs`` k asks for ``logprobs=k`` and gives
    each position's k most likely tokens, most likely first."""
    engine = make_engine(policy)
    llm = fakes.FakeLLM.instances[0]
    eos = policy[1].eos_token_id

    def script(prompt, sampling):
        ids = [10, 11, 12, eos]
        return fakes.Completion(token_ids=ids, finish_reason="stop", logprobs=[
            {t: fakes.Logprob(-0.5), 40 + i: fakes.Logprob(-0.25), 50 + i: fakes.Logprob(-3.0)}
            for i, t in enumerate(ids)])

    llm.script = staticmethod(script)
    reported = []

    async def one():
        def on_token(token, logprob, alternatives):
            reported.append((len(llm.llm_engine.batches), token, logprob, alternatives))

        return await engine.generate_one([5, 6], PARAMS, on_token=on_token, top_logprobs=2)

    generation = asyncio.run(one())
    assert generation.token_ids == [10, 11, 12, eos] and generation.logprobs == [-0.5] * 4
    assert [(step, token) for step, token, _, _ in reported] == [(1, 10), (2, 11), (3, 12), (4, eos)]
    assert reported[1][2:] == (-0.5, [(41, -0.25), (11, -0.5)])
    assert generation.extra["top_logprobs"] == [[(40 + i, -0.25), (t, -0.5)] for i, t in enumerate([10, 11, 12, eos])]
    (rid,) = llm.llm_engine.added
    kwargs = llm.llm_engine.sampling[rid].kwargs
    assert kwargs["output_kind"] is fakes.RequestOutputKind.CUMULATIVE and kwargs["logprobs"] == 2
