"""A flaky reward never silently corrupts a run: every kind of failure follows --reward-on-error,
is counted, and `raise` names the function, the sample and the original traceback."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import pytest

from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.combine import RewardSet
from rlhf.rewards.options import RewardOptions
from rlhf.rewards import RewardError

pytestmark = pytest.mark.unit

PROMPTS = ["first prompt", "second prompt", "third prompt"]
COMPLETIONS = ["1", "0", "2"]


def inverse(completions):
    return [1.0 / int(c) for c in completions]  # ZeroDivisionError on "0"


def inverse_per_sample(completion):
    return 1.0 / int(completion)


def source(fn, on_error="raise", **options):
    return FunctionSource(fn, fn.__name__, f"{fn.__name__} (rewards.py:1)", RewardOptions(on_error=on_error, **options))


def test_raise_names_function_sample_prompt_and_traceback():
    with pytest.raises(RewardError) as info:
        source(inverse_per_sample).score(PROMPTS, COMPLETIONS)
    message = str(info.value)
    assert "inverse_per_sample (rewards.py:1)" in message
    assert "failed on sample 1 (exception): ZeroDivisionError: float division by zero" in message
    assert "'second prompt'" in message
    assert "return 1.0 / int(completion)" in message  # the original traceback, with the source line
    assert "--reward-on-error zero|skip" in message
    assert info.value.failure.index == 1


@pytest.mark.parametrize("on_error, expected", [("zero", [1.0, 0.0, 0.5]), ("skip", [1.0, None, 0.5])])
def test_per_sample_exception_only_fails_that_sample(on_error, expected):
    result = RewardSet([source(inverse_per_sample, on_error)], on_error=on_error).score(PROMPTS, COMPLETIONS)
    assert result.total == expected
    assert result.metrics["reward/failures/inverse_per_sample"] == 1.0
    assert result.metrics["reward/skipped"] == (1.0 if on_error == "skip" else 0.0)
    assert result.first_error.index == 1 and result.first_error.reason == "exception"


def test_batched_exception_fails_every_sample_of_the_call():
    result = RewardSet([source(inverse, "zero")], on_error="zero").score(PROMPTS, COMPLETIONS)
    assert result.total == [0.0, 0.0, 0.0]
    assert result.metrics["reward/failures/inverse"] == 3.0


def test_skip_in_one_source_drops_the_sample_from_the_total():
    ok = source(lambda completions: [10.0] * len(completions))
    ok.name = "ok"
    rewards = RewardSet([ok, source(inverse_per_sample, "skip")], on_error="skip")
    result = rewards.score(PROMPTS, COMPLETIONS)
    assert result.total == [11.0, None, 10.5]
    assert result.per_source["ok"] == [10.0, 10.0, 10.0]


@pytest.mark.parametrize("returned, reason, text", [
    (0.5, "wrong length", "a single float, not a list of 3"),
    ([1.0, 2.0], "wrong length", "has 2 values for 3 samples"),
    ({"score": [1, 2, 3]}, "bad value", "without 'rewards'"),
    ({"rewards": [1.0]}, "wrong length", "'rewards' has 1 values for 3 samples"),
])
def test_unusable_batched_returns_fail_the_call(returned, reason, text):
    def bad(completions):
        return returned

    result = RewardSet([source(bad, "zero")], on_error="zero").score(PROMPTS, COMPLETIONS)
    assert result.total == [0.0, 0.0, 0.0]
    assert result.first_error.reason == reason and text in result.first_error.message


def test_non_finite_and_non_numeric_values_fail_only_their_sample():
    def odd(completions):
        return [float("nan"), "high", math.inf, 2]

    result = RewardSet([source(odd, "skip")], on_error="skip").score(["p"] * 4, ["a", "b", "c", "d"])
    assert result.total == [None, None, None, 2.0]
    assert result.metrics["reward/failures/odd"] == 3.0
    assert result.first_error.reason == "not finite"


def test_verl_dict_without_score_is_a_failure():
    result = RewardSet([source(lambda completion: {"acc": 1.0}, "zero")], on_error="zero").score(["p"], ["c"])
    assert result.total == [0.0]
    assert "without 'score'" in result.first_error.message


def test_async_timeout_is_a_failure_not_a_hang():
    async def stuck(completion):
        if completion == "hang":
            await asyncio.Event().wait()  # never set
        return 1.0

    result = RewardSet([source(stuck, "zero", timeout_s=0.2)], on_error="zero").score(["p", "p"], ["ok", "hang"])
    assert result.total == [1.0, 0.0]
    assert result.first_error.reason == "timeout" and "--reward-timeout" in result.first_error.message


def test_a_timeout_error_raised_by_the_function_is_an_exception_not_our_timeout():
    async def judge(completion):
        raise TimeoutError("judge API timed out")

    result = RewardSet([source(judge, "zero")], on_error="zero").score(["p"], ["c"])
    assert result.first_error.reason == "exception" and "judge API timed out" in result.first_error.message


def test_threaded_sync_timeout_abandons_the_call():
    release = threading.Event()

    def blocking(completions):
        release.wait(30)
        return [1.0] * len(completions)

    try:
        result = RewardSet([source(blocking, "skip", timeout_s=0.2, sync_in_thread=True)],
                           on_error="skip").score(["p"], ["c"])
    finally:
        release.set()
    assert result.total == [None]
    assert result.first_error.reason == "timeout"


def test_first_failure_is_logged_once_per_source(caplog):
    rewards = RewardSet([source(inverse_per_sample, "zero")], on_error="zero")
    with caplog.at_level(logging.WARNING, logger="rlhf.rewards"):
        rewards.score(PROMPTS, COMPLETIONS)
        rewards.score(PROMPTS, COMPLETIONS)
    records = [r for r in caplog.records if r.name == "rlhf.rewards"]
    assert len(records) == 1
    assert "ZeroDivisionError" in records[0].getMessage() and "sample 1" in records[0].getMessage()


def test_raise_is_the_default_policy():
    with pytest.raises(RewardError, match="sample 1"):
        RewardSet([source(inverse_per_sample)]).score(PROMPTS, COMPLETIONS)
