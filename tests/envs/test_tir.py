"""The TIR environment: which turns are tool calls, what the model sees back, when episodes end.

Step logic runs against a recording fake executor; a few tests run the real sandbox end to end.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from rlhf.core.types import StepResult
from rlhf.sandbox import SandboxResult
from rlhf.plugins.envs.tir import (
    STOP,
    TIRConfig,
    TIRConfigError,
    TIREnv,
    extract_tool_call,
    render_output,
    truncate_middle,
)

pytestmark = pytest.mark.unit

CALL = "Compute.\n```python\nprint(6 * 7)\n```\n"


@pytest.mark.parametrize(("action", "code"), [
    (CALL, "print(6 * 7)\n"),
    ("```python\nx = 1\nprint(x)\n```", "x = 1\nprint(x)\n"),  # ended by EOS: no newline
    ("```py\nprint(1)\n```\n\n", "print(1)\n"),
    ("```python3  \nprint(1)\n```\nThe", "print(1)\n"),  # the rest of the token that matched the stop
    ("```python\n```\n", ""),
    ("first\n```python\na = 1\n```\n```output\n\n```\nthen\n```python\nb = 2\n```\n", "b = 2\n"),
    ("```python\nprint(1)\n```\nSo the answer is 1.\n", None),  # text after the block: a final answer
    ("```python\nprint(1)\n", None),  # never closed
    ("```\nplain fence\n```\n", None),
    ("The answer is 42.", None),
    ("```python\ns = '```'\n```\n", "s = '```'\n"),  # only a fence at the start of a line closes
])
def test_extract_tool_call(action, code):
    assert extract_tool_call(action) == code


def test_truncate_middle_keeps_head_and_tail():
    assert truncate_middle("a" * 10 + "b" * 10, 9) == "aaaaaa\n[... 11 characters truncated ...]\nbbb"
    assert truncate_middle("short", 9) == "short"


def _result(status="ok", stdout="", stderr="", message="", truncated=False):
    return SandboxResult(status=status, stdout=stdout, stderr=stderr, message=message, stdout_truncated=truncated)


@pytest.mark.parametrize(("result", "show_traceback", "expected"), [
    (_result(stdout="42\n"), True, "42"),
    (_result(stdout="a\n", stderr="UserWarning: w\n"), True, "a\nUserWarning: w"),
    (_result("error", "partial\n", "Traceback (most recent call last):\n  ...\nValueError: x\n"), False,
     "partial\nValueError: x"),
    (_result("error", "", "Traceback (most recent call last):\nValueError: x\n"), True,
     "Traceback (most recent call last):\nValueError: x"),
    (_result("timeout", "tick\n"), True, "tick\nTimeoutError: the code ran longer than 5 s and was stopped"),
    (_result("killed", message="killed by SIGSEGV"), True, "Killed: killed by SIGSEGV"),
    (_result("sandbox_error", message="no python"), True, "SandboxError: no python"),
    (_result(stdout="xxx", truncated=True), True, "xxx\n[... output truncated ...]"),
    (_result(), True, ""),
])
def test_render_output(result, show_traceback, expected):
    assert render_output(result, TIRConfig(show_traceback=show_traceback)) == expected


class FakeExecutor:
    """Stands in for the sandbox: records the code and returns canned results."""

    def __init__(self, results):
        self.results, self.codes = list(results), []

    async def __call__(self, code):
        self.codes.append(code)
        return self.results.pop(0)


def make_env(results=(), **config) -> tuple[TIREnv, FakeExecutor]:
    env = TIREnv(TIRConfig(**config))
    fake = FakeExecutor(results)
    env.execute = fake
    env.reset("prompt", "label")
    return env, fake


def step(env: TIREnv, action: str) -> StepResult:
    return asyncio.run(env.step(action))


def test_a_tool_call_runs_the_code_and_fences_the_output():
    env, fake = make_env([_result(stdout="42\n")])
    result = step(env, CALL)
    assert fake.codes == ["print(6 * 7)\n"]
    assert result == StepResult(observation="```output\n42\n```\n", stop=STOP,
                                info={"tool_calls": 1, "sandbox_status": "ok", "sandbox_s": 0.0})
    result = step(env, "So the answer is \\boxed{42}.")
    assert result == StepResult(done=True, info={"end": "answer", "tool_calls": 1, "tool_errors": 0})


def test_the_observation_starts_on_its_own_line():
    env, _ = make_env([_result(stdout="1\n")])
    assert step(env, "```python\nprint(1)\n```").observation == "\n```output\n1\n```\n"


def test_max_tool_calls_then_generation_runs_free_then_ends():
    env, fake = make_env([_result(stdout="1\n"), _result("error", stderr="NameError: y\n")], max_tool_calls=2)
    first, second = step(env, CALL), step(env, CALL)
    assert (first.stop, second.stop) == (STOP, None)  # the last allowed call lifts the stop string
    assert second.observation == "```output\nNameError: y\n```\n"
    third = step(env, CALL)
    assert third == StepResult(done=True, info={"end": "max_tool_calls", "tool_calls": 2, "tool_errors": 1})
    assert len(fake.codes) == 2


def test_a_turn_stopped_on_another_fence_continues_a_bounded_number_of_times():
    env, fake = make_env(max_continuations=2)
    opening = "Here is the table:\n```\n"
    assert step(env, opening) == StepResult(stop=STOP, info={"continued": True})
    assert step(env, "a | b\n```\n") == StepResult(stop=STOP, info={"continued": True})
    assert step(env, "```\n").done  # third time: the episode ends
    assert fake.codes == []


def test_reset_starts_a_fresh_episode():
    env, _ = make_env([_result(stdout="1\n")], max_tool_calls=1)
    step(env, CALL)
    env.reset("again", None)
    assert (env.tool_calls, env.cells) == (0, [])


def test_config_is_validated():
    with pytest.raises(TIRConfigError, match="unknown sandbox option"):
        TIRConfig(sandbox_options={"timeout": 1})
    with pytest.raises(TIRConfigError, match="max_tool_calls must be > 0"):
        TIRConfig(max_tool_calls=0)


# --- with the real sandbox ------------------------------------------------------------------

real = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")


@real
def test_real_errors_timeouts_and_truncation_are_rendered():
    env = TIREnv(TIRConfig(timeout_s=1))
    env.reset("p", "l")
    error = step(env, "```python\nx = [1]\nx[3]\n```\n").observation
    assert error.startswith('```output\nTraceback (most recent call last):\n  File "<string>", line 2, in <module>\n'
                            "    x[3]\n")  # the source line is shown (then carets, on newer Pythons)
    assert error.endswith("\nIndexError: list index out of range\n```\n")
    env = TIREnv(TIRConfig(timeout_s=1, max_output_chars=100))
    env.reset("p", "l")
    timeout = step(env, "```python\nprint('start', flush=True)\nwhile True:\n    pass\n```\n").observation
    assert timeout == "```output\nstart\nTimeoutError: the code ran longer than 1 s and was stopped\n```\n"
    long = step(env, "```python\nprint('x' * 5000)\n```\n").observation
    assert long == "```output\n" + "x" * 66 + "\n[... 4900 characters truncated ...]\n" + "x" * 34 + "\n```\n"


@real
@pytest.mark.parametrize(("persist", "expected"), [(True, "42"), (False, "NameError: name 'x' is not defined")])
def test_persist_state_replays_earlier_cells_silently(persist, expected):
    env = TIREnv(TIRConfig(persist_state=persist, show_traceback=False))
    env.reset("p", "l")
    assert step(env, "```python\nx = 6\nprint('first')\n```\n").observation == "```output\nfirst\n```\n"
    assert step(env, "```python\nprint(x * 7)\n```\n").observation == f"```output\n{expected}\n```\n"


@real
def test_many_trajectories_step_concurrently():
    async def episode(i):
        env = TIREnv()
        env.reset("p", "l")
        return (await env.step(f"```python\nprint({i} ** 2)\n```\n")).observation

    async def main():
        return await asyncio.gather(*(episode(i) for i in range(6)))

    assert asyncio.run(main()) == [f"```output\n{i ** 2}\n```\n" for i in range(6)]
