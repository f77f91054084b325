"""The environment contract's host-side helpers: routing, the async adapter and its checks,
and the scripted-episode check behind ``rlhf plugins check``."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from rlhf.core.protocols.environment import (
    AsyncEnv,
    EnvContractError,
    Environment,
    call_maybe_async,
    check_env,
    route_env,
)
from rlhf.core.types import StepResult
from rlhf.plugins.envs.single_turn import SingleTurnEnv
from rlhf.plugins.envs.tir import TIREnv

pytestmark = pytest.mark.unit

# --- routing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("label", "expected"), [
    ({"env_func": "tir", "answer": "42"}, ("tir", {"env_func": "tir", "answer": "42"})),
    (json.dumps({"env_func": " my_pkg:Env ", "task": "math"}), ("my_pkg:Env", {"env_func": " my_pkg:Env ", "task": "math"})),
    ('{"answer": 42}', ("single_turn", '{"answer": 42}')),  # JSON without env_func: untouched string
    ("42", ("single_turn", "42")),
    ("{not json", ("single_turn", "{not json")),
    ({"answer": 1}, ("single_turn", {"answer": 1})),
    ([1, 2], ("single_turn", [1, 2])),
    (None, ("single_turn", None)),
])
def test_route_env(label, expected):
    assert route_env(label, "single_turn") == expected


@pytest.mark.parametrize("bad", [{"env_func": ""}, {"env_func": 3}, '{"env_func": null}'])
def test_route_env_rejects_a_bad_env_func(bad):
    with pytest.raises(EnvContractError, match="env_func"):
        route_env(bad, "single_turn")


def test_a_routed_label_is_a_copy():
    label = {"env_func": "tir"}
    _, routed = route_env(label, "x")
    routed["seen"] = True
    assert label == {"env_func": "tir"}


# --- the async adapter ------------------------------------------------------------------------


class SyncEnv:
    stop = ["\n"]

    def reset(self, prompt, label, difficulty):
        self.seen = (prompt, label, difficulty)
        return f"[{difficulty}]"

    def step(self, action_text):
        return StepResult(observation="obs", reward=1, done=action_text == "end", stop=("x",))


class AsyncKwargsEnv:
    async def reset(self, prompt, label, **columns):
        self.columns = columns
        return None

    async def step(self, action_text):
        return {"observation": action_text.upper(), "done": True}

    async def close(self):
        self.closed = True


def test_sync_env_through_the_adapter_gets_declared_columns_only():
    env = AsyncEnv(SyncEnv())
    assert env.stop == ["\n"]
    columns = {"difficulty": "hard", "source": "x", "prompt": "dup", "label": "dup"}
    assert asyncio.run(env.reset("p", "l", columns)) == "[hard]"
    assert env.env.seen == ("p", "l", "hard")
    result = asyncio.run(env.step("end"))
    assert (result.observation, result.reward, result.done, result.stop) == ("obs", 1.0, True, ["x"])
    assert isinstance(result.reward, float)


def test_async_env_with_kwargs_gets_every_column_and_dicts_are_accepted():
    inner = AsyncKwargsEnv()
    env = AsyncEnv(inner)

    async def episode():
        await env.reset("p", "l", {"a": 1, "b": 2, "label": "dup"})
        result = await env.step("hi")
        await env.close()
        return result

    result = asyncio.run(episode())
    assert inner.columns == {"a": 1, "b": 2}
    assert (result.observation, result.done, result.reward, result.stop) == ("HI", True, 0.0, None)
    assert inner.closed


class Returns:
    def __init__(self, value):
        self.value = value

    def reset(self, prompt, label):
        return self.value if not isinstance(self.value, StepResult) else None

    def step(self, action_text):
        return self.value


@pytest.mark.parametrize(("value", "match"), [
    (("obs", 0.0, True, {}), "must return rlhf.core.types.StepResult"),
    (StepResult(observation=3), "observation must be a str"),
    (StepResult(reward=math.nan), "reward must be finite"),
    (StepResult(reward="high"), "reward must be a number"),
    (StepResult(done="yes"), "done must be a bool"),
    (StepResult(info=[]), "info must be a dict"),
    (StepResult(stop="```"), "list of non-empty strings"),
    ({"observation": "x", "next_state": 1}, "unknown key"),
])
def test_step_results_are_checked(value, match):
    with pytest.raises(EnvContractError, match=match):
        asyncio.run(AsyncEnv(Returns(value)).step("a"))


def test_reset_must_return_text_or_none():
    with pytest.raises(EnvContractError, match="reset must return"):
        asyncio.run(AsyncEnv(Returns(5)).reset("p", "l"))


def test_objects_without_step_are_not_environments():
    with pytest.raises(EnvContractError, match="needs reset\\(\\) and step\\(\\)"):
        AsyncEnv(object())
    assert isinstance(TIREnv(), Environment) and isinstance(SingleTurnEnv(), Environment)


def test_call_maybe_async():
    async def twice(x):
        return 2 * x

    assert asyncio.run(call_maybe_async(lambda x: x + 1, 1)) == 2
    assert asyncio.run(call_maybe_async(twice, 4)) == 8


# --- check_env ------------------------------------------------------------------------------


class NeverDone:
    def reset(self, prompt, label):
        return None

    def step(self, action_text):
        return StepResult()


class Raises:
    def reset(self, prompt, label):
        return None

    def step(self, action_text):
        raise ValueError("broken step")


class Scripted:
    sample_actions = ["first", "second"]
    sample_label = {"answer": 2}

    def reset(self, prompt, label):
        self.label = label
        return "go"

    def step(self, action_text):
        return StepResult(observation="ok", reward=0.5, done=action_text == "second")


def test_check_env_runs_the_scripted_actions():
    lines = check_env(Scripted)
    assert lines[0] == "class is importable and picklable by reference"
    assert "reset('What is 6 times 7?', {'answer': 2}) -> 'go'" in lines
    assert lines[-1] == "episode ended after 2 turn(s)"
    assert sum(line.startswith("step ") for line in lines) == 2


@pytest.mark.parametrize(("env_cls", "match"), [
    (NeverDone, "did not end the scripted episode within 8 turns"),
    (Raises, "Raises.step raised ValueError: broken step"),
])
def test_check_env_reports_broken_envs(env_cls, match):
    with pytest.raises(EnvContractError, match=match):
        check_env(env_cls)


def test_check_env_requires_an_importable_class():
    class Local(Scripted):
        pass

    with pytest.raises(EnvContractError, match="cannot be pickled by reference"):
        check_env(Local)


def test_plain_methods_run_in_a_worker_thread_unless_the_env_says_they_do_not_block():
    import threading

    class Recording:
        def __init__(self):
            self.threads = []

        def reset(self, prompt, label):
            self.threads.append(threading.get_ident())

        def step(self, action_text):
            self.threads.append(threading.get_ident())
            return StepResult(done=True)

    class Cheap(Recording):
        blocking = False

    async def run(env):
        wrapped = AsyncEnv(env)
        await wrapped.reset("p", "l")
        await wrapped.step("a")
        return threading.get_ident()

    blocking, cheap = Recording(), Cheap()
    loop_thread = asyncio.run(run(blocking))
    assert len(blocking.threads) == 2 and loop_thread not in blocking.threads
    loop_thread = asyncio.run(run(cheap))
    assert cheap.threads == [loop_thread, loop_thread]
    assert SingleTurnEnv.blocking is False  # the default env runs inline
