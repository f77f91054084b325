"""Reward functions written for OpenRLHF, TRL and verl run unchanged, sync and async, batched and
per-sample, and get exactly the inputs their convention promises."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from rlhf.core.types import Trajectory
from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.loading import build_set
from rlhf.rewards.options import RewardOptions
from rlhf.rewards import RewardConfigError, load_reward, load_rewards

pytestmark = pytest.mark.unit

STYLE = Path(__file__).with_name("style_functions.py")


def trajectory(prompt, prompt_text, completion, label=None, **columns) -> Trajectory:
    return Trajectory(token_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], prompt_length=2, prompt=prompt,
                      prompt_text=prompt_text, completion_text=completion, group=0, label=label, columns=columns)


def test_openrlhf_reward_func_file_default_attr(plugins):
    # The queries start with the templated prompt text, so `query[len(prompt):]` is the response.
    source = load_reward(str(STYLE), plugins=plugins)
    assert source.name == "reward_func"
    trajs = [trajectory("2+2?", "<|im_start|>user\n2+2?<|im_end|>\n", "4", label="4"),
             trajectory("3+3?", "<|im_start|>user\n3+3?<|im_end|>\n", " 5", label="6")]
    result = load_rewards([str(STYLE)], plugins=plugins).score_trajectories(trajs)
    assert result.total == [1.0, 0.0]
    assert result.per_source == {"reward_func": [1.0, 0.0]}
    assert result.metrics["reward/reward_func"] == 0.5


def test_openrlhf_dict_with_scores_and_extra_logs(plugins):
    rewards = load_rewards([f"{STYLE}:reward_func_dict"], plugins=plugins)
    result = rewards.score(["p1", "p2"], ["abcde", "ab"], ["x", "y"])
    assert result.total == [5.0, 2.0]
    assert result.scores == {"reward_func_dict": [1.0, 0.0]}
    assert result.metrics["reward/reward_func_dict/score"] == 0.5
    assert result.metrics["reward/reward_func_dict/response_length"] == 3.5
    assert result.metrics["reward/reward_func_dict/dummy"] == 7.0


def test_trl_conversational_completions_and_label_column_by_name(plugins):
    seen = {}

    def spy(prompts, completions, solution, **kwargs):
        seen.update(prompts=prompts, completions=completions, solution=solution, kwargs=sorted(kwargs))
        return [0.0] * len(completions)

    chat = [{"role": "user", "content": "Answer 7"}]
    trajs = [trajectory(chat, "T:Answer 7", "<answer>7</answer>", label="7", solution="7", level=1),
             trajectory(chat, "T:Answer 7", "<answer>8</answer>", label="7", solution="7", level=2),
             trajectory(chat, "T:Answer 7", "no answer", label=None, solution=None, level=3)]
    result = load_rewards([f"{STYLE}:accuracy_reward"], plugins=plugins).score_trajectories(trajs)
    assert result.per_source["accuracy_reward"] == [1.0, 0.0, None]
    assert result.total == [1.0, 0.0, None]  # TRL's None: no score, the sample is dropped
    assert result.metrics["reward/skipped"] == 1.0

    FunctionSource(spy, "spy", "spy").score_batch(build_batch(trajs))
    assert seen["prompts"] == [chat, chat, chat]  # TRL gets the dataset prompts, not the template
    assert seen["completions"][0] == [{"role": "assistant", "content": "<answer>7</answer>"}]
    assert seen["solution"] == ["7", "7", None]
    assert seen["kwargs"] == ["completion_ids", "labels", "level", "queries"]


def build_batch(trajs):
    from rlhf.rewards.source import RewardBatch

    return RewardBatch.from_trajectories(trajs)


def test_trl_plain_text_completions_with_columns_in_kwargs(plugins):
    result = load_rewards([f"{STYLE}:length_reward"], plugins=plugins).score(
        ["say hi", "say bye"], ["hi", "bye!"], difficulty=[1.0, 0.5])
    assert result.total == [2.0, 2.0]


def test_verl_compute_score_per_sample(plugins):
    source = load_reward("tests.rewards.style_functions:compute_score", plugins=plugins)
    assert source.plan.batched is False
    values = source.score(["q1", "q2", "q3"], ["so 42", "so 41", "so 42"], ["42", "42", "42"],
                          data_source=["openai/gsm8k", None, "math"])
    assert values == [1.5, 0.0, 1.0]  # data_source None -> "default" (no bonus)


def test_verl_dict_score_and_extra_info(plugins):
    rewards = load_rewards(["tests.rewards.style_functions:compute_score_dict"], plugins=plugins)
    result = rewards.score(["q1", "q2"], ["a", "b"], ["a", "a"], extra_info=[{"split": "train"}, {"split": "test"}])
    assert result.total == [1.0, 0.0]
    assert result.metrics["reward/compute_score_dict/acc"] == 1.0
    assert result.metrics["reward/compute_score_dict/split_is_train"] == 0.5


def test_verl_extra_info_is_the_row_without_an_extra_info_column():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 1.0

    FunctionSource(compute_score, "cs", "cs").score(["p"], ["sol"], ["gt"], index=[3], topic=["algebra"])
    assert seen == [("default", "sol", "gt", {"index": 3, "topic": "algebra"})]


def test_only_declared_parameters_are_passed():
    calls = []

    def label_only(labels):
        calls.append(labels)
        return [1.0 for _ in labels]

    FunctionSource(label_only, "l", "l").score(["p"], ["c"], ["y"], unrelated=[1])
    assert calls == [["y"]]


def test_async_batched_function(plugins):
    result = load_rewards([f"{STYLE}:async_judge"], plugins=plugins).score(["a", "b"], ["yes", "no"])
    assert result.total == [1.0, 0.0]


def test_async_per_sample_functions_run_concurrently_within_the_bound():
    running, peak = 0, 0

    async def judge(completion):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1
        return float(len(completion))

    source = FunctionSource(judge, "judge", "judge", RewardOptions(async_concurrency=3))
    assert source.plan.is_async and not source.plan.batched
    assert source.score(["p"] * 8, ["a" * i for i in range(8)]) == [float(i) for i in range(8)]
    assert peak == 3


def test_async_api_twin_matches_sync():
    async def main():
        source = FunctionSource(lambda completions: [len(c) for c in completions], "n", "n")
        return await source.ascore(["p", "p"], ["ab", "abc"])

    assert asyncio.run(main()) == [2.0, 3.0]


def test_sync_functions_run_in_the_calling_thread_unless_asked():
    threads = []

    def where(completions):
        threads.append(threading.current_thread() is threading.main_thread())
        return [0.0] * len(completions)

    FunctionSource(where, "w", "w").score(["p"], ["c"])
    FunctionSource(where, "w", "w", RewardOptions(sync_in_thread=True)).score(["p"], ["c"])
    assert threads == [True, False]


def test_async_api_runs_sync_functions_in_worker_threads_with_the_timeout():
    release = threading.Event()

    def slow_or_where(completion):
        if completion == "stuck":
            release.wait(30)
        return float(threading.current_thread() is threading.main_thread())

    source = FunctionSource(slow_or_where, "s", "s", RewardOptions(timeout_s=0.2, on_error="skip"))
    try:
        assert asyncio.run(source.ascore(["p", "p"], ["here", "stuck"])) == [0.0, None]
    finally:
        release.set()


def test_mismatched_lists_are_refused():
    with pytest.raises(RewardConfigError, match="3 completions but 2 prompts, 1 labels"):
        FunctionSource(lambda completions: [0.0] * 3, "x", "x").score(["a", "b"], ["1", "2", "3"], ["y"])


def test_sync_score_works_inside_a_running_event_loop():
    async def notebook_cell():
        async def judge(completions):
            await asyncio.sleep(0)
            return [1.0] * len(completions)

        return FunctionSource(judge, "j", "j").score(["p"], ["c"])  # sync call from async code (Jupyter)

    assert asyncio.run(notebook_cell()) == [1.0]


def test_registration_flag_overrides_the_batched_guess(plugins, make_plugin):
    def n_tokens(completion_ids):  # no marker name: guessed batched, registered as per-sample
        return float(len(completion_ids))

    def register_rewards(register):
        register("n_tokens", n_tokens, batched=False)

    plugins.register(make_plugin("p", register_rewards=register_rewards))
    source = load_reward("n_tokens", plugins=plugins)
    assert source.score(["p", "p"], ["ab", "abcd"], completion_ids=[[5, 6], [7, 8, 9]]) == [2.0, 3.0]
    assert FunctionSource(n_tokens, "guess", "guess").plan.batched is True


def test_a_missing_input_is_a_configuration_error_even_under_skip():
    def needs_rubric(completions, rubric):
        return [0.0] * len(completions)

    source = FunctionSource(needs_rubric, "r", "needs_rubric (my.py:1)", RewardOptions(on_error="skip"))
    with pytest.raises(RewardConfigError, match=r"needs the argument 'rubric'.*dataset column \(topic\)"):
        source.score(["p"], ["c"], topic=["x"])


def test_mixing_batched_and_per_sample_inputs_is_refused():
    with pytest.raises(RewardConfigError, match="batch inputs .*completions.* per-sample inputs .*label"):
        FunctionSource(lambda completions, label: 0.0, "x", "x")


def test_weighted_combination_and_unique_names(plugins, tmp_path):
    (tmp_path / "more.py").write_text(
        "def reward_func(completions):\n    return [None if c == 'abstain' else 1.0 for c in completions]\n")
    rewards = load_rewards(["exact_match@2", "exact_match@0.5", f"{tmp_path / 'more.py'}@-1",
                            "boxed_math@0"], plugins=plugins)
    assert rewards.names == ["exact_match", "exact_match_2", "reward_func", "boxed_math"]
    result = rewards.score(["p"] * 3, ["7", "8", "abstain"], ["7", "7", "7"])
    # sample 0: 2*1 + 0.5*1 - 1*1 = 1.5; sample 1: 0 + 0 - 1 = -1; sample 2: 0 + 0 + (abstains) = 0.
    assert result.total == [1.5, -1.0, 0.0]
    assert result.per_source["boxed_math"] == [0.0, 0.0, 0.0]  # weight 0: logged, not added
    assert result.metrics["reward/reward_func"] == 1.0
    assert result.metrics["reward/exact_match"] == pytest.approx(1 / 3)
    assert result.metrics["reward/mean"] == pytest.approx(0.5 / 3)


def test_a_source_scoring_nothing_gives_none_total(plugins):
    rewards = load_rewards(["exact_match"], plugins=plugins)
    result = rewards.score(["p", "p"], ["a", "b"], [None, "b"])
    assert result.total == [None, 1.0]
    assert result.metrics["reward/skipped"] == 1.0


def test_assign_writes_rewards_into_trajectories(plugins):
    trajs = [trajectory("p", "p", "7", label="7"), trajectory("p", "p", "8", label="7")]
    result = load_rewards(["exact_match@3"], plugins=plugins).score_trajectories(trajs)
    result.assign(trajs)
    assert [t.reward for t in trajs] == [3.0, 0.0]
    assert trajs[0].rewards == {"exact_match": 1.0}


def test_async_trajectory_api(plugins):
    trajs = [trajectory("p", "p", "7", label="7")]
    rewards = load_rewards(["exact_match", f"{STYLE}:async_judge"], plugins=plugins)
    result = asyncio.run(rewards.ascore_trajectories(trajs))
    assert result.per_source == {"exact_match": [1.0], "async_judge": [0.0]}


def test_build_set_without_specs_says_what_to_pass():
    with pytest.raises(RewardConfigError, match="--reward SPEC"):
        build_set([], None, RewardOptions())
