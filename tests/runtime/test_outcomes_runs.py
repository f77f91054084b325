"""Typed outcomes and the failure policies through ``rlhf train`` on the tiny model, each outcome
produced by a real failing component: a reward that returns NaN (reward_error), an environment
that raises (env_error) or hangs past ``--env-timeout-s`` (tool_timeout), the token budget
(truncated); the advantages the estimator gave, checked by hand against the outcomes in
samples.jsonl; the same command twice, and an interrupted run resumed, equal to one run with
its retries (docs/outcomes.md)."""

from __future__ import annotations

import signal

import pytest
import torch

from rlhf.core.errors import RunInterrupted
from tests.helpers import FLAKY_TOOL, final_weights, read_jsonl, run_cli, small_config, write_jsonl

pytestmark = pytest.mark.run

# NaN (a per-sample failure) for about one completion in three, as a function of its text only.
FLAKY_REWARD = '''
import os
from pathlib import Path

def reward_func(completions, **kwargs):
    if os.environ.get("CALLS_FILE"):
        counter = Path(os.environ["CALLS_FILE"])
        calls = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(calls))
        if calls == int(os.environ.get("SIGNAL_ON_CALL", "0")):
            os.kill(os.getpid(), signal_number())
    return [float("nan") if sum(map(ord, c)) % 3 == 0 else len(c) / 10 for c in completions]

def signal_number():
    import signal
    return signal.SIGTERM
'''

# Raises on the prompt "boom", sleeps past any small --env-timeout-s on "slow", else ends at once.
ENVS = '''
import time
from rlhf.core.types import StepResult

class Tools:
    def reset(self, prompt, label):
        self.prompt = prompt

    def step(self, action_text):
        if "boom" in self.prompt:
            raise ValueError("the tool crashed")
        if "slow" in self.prompt:
            time.sleep(1.5)
        return StepResult(reward=1.0, done=True)
'''

RECORDED: list[dict] = []


def recording_rloo(inputs, config):
    from rlhf.plugins.algorithms.rloo import rloo_advantages

    advantages, returns = rloo_advantages(inputs, config)
    RECORDED.append({"rewards": inputs.rewards.clone(), "valid": inputs.sample_mask.clone(),
                     "advantages": advantages.clone(), "action_mask": inputs.action_mask.clone()})
    return advantages, returns


@pytest.fixture
def flaky(tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text(FLAKY_REWARD)
    return path


def train_args(tiny_model_dir, data, out, *extra):
    return ["train", "--model", str(tiny_model_dir), "--data", str(data), "--label-key", "answer",
            "--prompts-per-step", "2", "--n-samples", "3", "--max-new-tokens", "4", "--steps", "3", "--lr", "1e-3",
            "--micro-batch-size", "3", "--seed", "7", "--out", str(out), "--no-progress", *extra]


def comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and "per_s" not in k}
            for row in rows]


def test_reward_errors_under_mask_leave_the_baseline_to_the_others(tiny_model_dir, task, flaky, tmp_path, plugins,
                                                                   make_plugin):
    RECORDED.clear()
    plugins.register(make_plugin("recording", register_advantage_estimators=lambda register: register(
        "recording_rloo", f"{__name__}:recording_rloo", needs_groups=True, supports_masking=True)))
    out = tmp_path / "run"
    result = run_cli(plugins, train_args(tiny_model_dir, task / "data.jsonl", out, "--reward", str(flaky),
                                         "--reward-on-error", "fail", "--on-failure", "mask", "--advantage",
                                         "recording_rloo"))
    assert result.exit_code == 0, result.output
    samples, metrics = read_jsonl(out / "samples.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert len(samples) == 18 and len(RECORDED) == 3  # mask keeps every group: 2 x 3 samples a step
    failed = [s for s in samples if s["outcome"] == "reward_error"]
    assert failed, "the flaky reward failed on no sample: pick another seed"
    for sample in failed:
        assert sample["error"] == "reward 'reward_func' failed (not finite): returned nan" and sample["reward"] == 0.0
    assert {s["outcome"] for s in samples} - {"reward_error"} == {"truncated"}  # 4 new tokens: the budget ends them
    for step, record in enumerate(RECORDED):
        rows = [s for s in samples if s["step"] == step + 1]
        assert record["valid"].tolist() == [s["outcome"] != "reward_error" for s in rows]
        rewards, valid = record["rewards"].view(2, 3).tolist(), record["valid"].view(2, 3).tolist()
        for g in range(2):
            for i in range(3):
                got = record["advantages"][3 * g + i][record["action_mask"][3 * g + i].bool()]
                others = [rewards[g][j] for j in range(3) if j != i and valid[g][j]]
                if not valid[g][i]:
                    expected = 0.0  # the failed sample: advantage 0
                elif not others:
                    expected = 0.0  # no other successful sample: nothing to compare with
                else:
                    expected = rewards[g][i] - sum(others) / len(others)  # RLOO over the successful others
                assert torch.allclose(got, torch.full_like(got, expected), atol=1e-6), (step, g, i)
        assert metrics[step]["outcome/reward_error_rate"] == pytest.approx(sum(not v for v in record["valid"]) / 6)


def test_an_environment_that_raises_is_retried_with_new_seeds_then_its_group_dropped(tiny_model_dir, tmp_path,
                                                                                      plugins):
    (tmp_path / "tools.py").write_text(ENVS)
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": p, "answer": "1"}
                                                 for p in ("fine one", "boom", "fine two", "fine three")])
    out = tmp_path / "run"
    result = run_cli(plugins, train_args(tiny_model_dir, data, out, "--env", f"{tmp_path / 'tools.py'}:Tools",
                                         "--steps", "2"))
    assert result.exit_code == 0, result.output
    samples, metrics = read_jsonl(out / "samples.jsonl"), read_jsonl(out / "metrics.jsonl")
    # "boom"'s group: 3 samples failed, each retried twice (--max-retries 2), then dropped
    assert sum(m["outcome/retries"] for m in metrics) == 6 and sum(m["outcome/dropped_groups"] for m in metrics) == 1
    assert sum(m["outcome/env_error_rate"] for m in metrics) == pytest.approx(3 / 6)
    assert len(samples) == 9 and all("boom" not in s["prompt"] for s in samples)
    for sample in samples:  # the others ended as their finish reason says: a limit's is truncated
        truncated = sample["finish_reason"] in ("length", "budget", "max_turns")
        assert (sample["outcome"], sample["error"]) == ("truncated" if truncated else "ok", None)


def test_drop_group_and_a_hanging_tool(tiny_model_dir, tmp_path, plugins):
    (tmp_path / "tools.py").write_text(ENVS)
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": p, "answer": "1"} for p in ("slow", "fine")])
    out = tmp_path / "run"
    result = run_cli(plugins, train_args(tiny_model_dir, data, out, "--env", f"{tmp_path / 'tools.py'}:Tools",
                                         "--steps", "1", "--env-timeout-s", "0.2", "--on-failure", "mask"))
    assert result.exit_code == 0, result.output
    samples = read_jsonl(out / "samples.jsonl")
    slow = [s for s in samples if "slow" in s["prompt"]]
    assert [s["outcome"] for s in slow] == ["tool_timeout"] * 3
    env = f"{tmp_path / 'tools.py'}:Tools"
    assert all(s["error"] == f"environment {env!r} timed out on {data} row 1: took longer than --env-timeout-s 0.2"
               for s in slow)
    assert read_jsonl(out / "metrics.jsonl")[0]["outcome/tool_timeout_rate"] == 0.5

    out = tmp_path / "dropped"
    result = run_cli(plugins, train_args(tiny_model_dir, data, out, "--env", f"{tmp_path / 'tools.py'}:Tools",
                                         "--steps", "1", "--env-timeout-s", "0.2", "--on-failure", "drop-group"))
    assert result.exit_code == 0, result.output
    assert {s["prompt"] for s in read_jsonl(out / "samples.jsonl")} == {"fine"}
    metrics = read_jsonl(out / "metrics.jsonl")[0]
    assert metrics["outcome/dropped_groups"] == 1.0 and metrics["outcome/retries"] == 0.0


def test_every_group_failing_stops_the_run_with_the_first_failure(tiny_model_dir, tmp_path, plugins):
    (tmp_path / "tools.py").write_text(ENVS)
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "boom", "answer": "1"}] * 2)
    result = run_cli(plugins, train_args(tiny_model_dir, data, tmp_path / "run", "--env",
                                         f"{tmp_path / 'tools.py'}:Tools", "--steps", "1", "--max-retries", "1"))
    assert result.exit_code == 1
    env = f"{tmp_path / 'tools.py'}:Tools"
    assert (f"step 1: every prompt group failed (--on-failure retry); the first failure: env_error: environment "
            f"{env!r} failed on {tmp_path / 'data.jsonl'} row 1: ValueError: the tool crashed") in result.output


def test_mask_with_an_estimator_that_does_not_support_it_is_refused(tiny_model_dir, task, tmp_path, plugins,
                                                                     make_plugin):
    plugins.register(make_plugin("plain", register_advantage_estimators=lambda register: register(
        "plain_rloo", "rlhf.plugins.algorithms.rloo:rloo_advantages", needs_groups=True)))
    for flags in (["--on-failure", "mask"], ["--reward-on-error", "skip"]):
        result = run_cli(plugins, train_args(tiny_model_dir, task / "data.jsonl", tmp_path / "run", "--reward",
                                             str(task / "rewards.py"), "--advantage", "plain_rloo", *flags))
        assert result.exit_code == 2, result.output
        assert (f"{' '.join(flags)} keeps failed samples in their groups, masked, and the advantage estimator "
                "'plain_rloo' does not declare supports_masking") in result.output
        assert not (tmp_path / "run").exists()


def test_the_same_command_twice_gives_the_same_samples_with_retries(tiny_model_dir, task, flaky, tmp_path, plugins):
    runs = []
    for name in ("first", "second"):
        out = tmp_path / name
        result = run_cli(plugins, train_args(tiny_model_dir, task / "data.jsonl", out, "--reward", str(flaky),
                                             "--reward-on-error", "fail"))
        assert result.exit_code == 0, result.output
        runs.append(out)
    metrics = read_jsonl(runs[0] / "metrics.jsonl")
    assert sum(m["outcome/retries"] for m in metrics) > 0  # the batches had retries
    assert read_jsonl(runs[0] / "samples.jsonl") == read_jsonl(runs[1] / "samples.jsonl")
    assert comparable(metrics) == comparable(read_jsonl(runs[1] / "metrics.jsonl"))
    first, second = final_weights(runs[0]), final_weights(runs[1])
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_skip_is_fail_with_mask(tiny_model_dir, task, flaky, tmp_path, plugins):
    outs = {}
    for name, flags in (("skip", ["--reward-on-error", "skip"]),
                        ("fail_mask", ["--reward-on-error", "fail", "--on-failure", "mask"])):
        outs[name] = tmp_path / name
        result = run_cli(plugins, train_args(tiny_model_dir, task / "data.jsonl", outs[name], "--reward", str(flaky),
                                             "--steps", "2", *flags))
        assert result.exit_code == 0, result.output
    assert read_jsonl(outs["skip"] / "samples.jsonl") == read_jsonl(outs["fail_mask"] / "samples.jsonl")
    assert any(s["outcome"] == "reward_error" for s in read_jsonl(outs["skip"] / "samples.jsonl"))


def test_resume_after_an_interrupt_with_retries_equals_the_uninterrupted_run(tiny_model_dir, task, flaky, tmp_path,
                                                                            monkeypatch):
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.rl.local import train

    def config(out, **extra):
        return small_config(tiny_model_dir, task, out, reward=[str(flaky)], reward_on_error="fail", n_samples=3,
                            micro_batch_size=3, **{"steps": 3, **extra})

    plugins = build_plugin_manager(load_entrypoints=False)
    whole = train(config(tmp_path / "whole"), plugins=plugins)
    retries = [m["outcome/retries"] for m in read_jsonl(whole / "metrics.jsonl")]
    assert retries[1] > 0, retries  # step 2 has a retry: the interrupt lands in it

    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    train(config(tmp_path / "one", steps=1), plugins=plugins)  # step 1 alone: its reward calls counted
    step_1_calls = int((tmp_path / "calls").read_text())
    (tmp_path / "calls").unlink()
    monkeypatch.setenv("SIGNAL_ON_CALL", str(step_1_calls + 2))  # step 2's batch scored again after a retry
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "stopped"
    with pytest.raises(RunInterrupted, match=r"interrupted \(SIGTERM\) after step 2/3"):
        train(config(out), plugins=plugins)
    assert signal.getsignal(signal.SIGTERM) == before
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    monkeypatch.setenv("SIGNAL_ON_CALL", "0")
    train(config(out, resume=True), plugins=plugins)
    assert comparable(read_jsonl(out / "metrics.jsonl")) == comparable(read_jsonl(whole / "metrics.jsonl"))
    assert read_jsonl(out / "samples.jsonl") == read_jsonl(whole / "samples.jsonl")
    got, expected = final_weights(out), final_weights(whole)
    assert all(torch.equal(got[k], expected[k]) for k in expected)




def test_async_at_staleness_zero_retries_as_the_synchronous_run(tiny_model_dir, task, flaky, tmp_path, plugins):
    outs = {}
    for name, flags in (("sync", []), ("async", ["--async", "--max-staleness", "0"])):
        outs[name] = tmp_path / name
        result = run_cli(plugins, train_args(tiny_model_dir, task / "data.jsonl", outs[name], "--reward", str(flaky),
                                             "--reward-on-error", "fail", *flags))
        assert result.exit_code == 0, result.output
    metrics = read_jsonl(outs["async"] / "metrics.jsonl")
    assert sum(m["outcome/retries"] for m in metrics) > 0  # the batches had retries
    assert read_jsonl(outs["async"] / "samples.jsonl") == read_jsonl(outs["sync"] / "samples.jsonl")
    keys = ("reward/mean", "policy/loss", "outcome/retries", "outcome/reward_error_rate", "outcome/dropped_groups")
    assert [{k: m[k] for k in keys} for m in metrics] == \
        [{k: m[k] for k in keys} for m in read_jsonl(outs["sync"] / "metrics.jsonl")]
    first, second = final_weights(outs["sync"]), final_weights(outs["async"])
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("partial", [False, True], ids=["async", "partial"])
def test_async_retries_a_failing_environment_with_the_advantages_of_its_new_samples(tiny_model_dir, tmp_path,
                                                                                   plugins, make_plugin, partial):
    """--async --max-staleness 2: an environment that crashes on some sampled texts; its samples are
    generated again from their own seeds (by the batch's version, within the bound), the advantages
    are RLOO's over the samples as they ended, and the same command twice is the same run."""
    (tmp_path / "tools.py").write_text(FLAKY_TOOL)
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)])
    plugins.register(make_plugin("recording", register_advantage_estimators=lambda register: register(
        "recording_rloo", f"{__name__}:recording_rloo", needs_groups=True, supports_masking=True)))
    runs, recorded = [], []
    for name in ("first", "second"):
        RECORDED.clear()
        out = tmp_path / name
        result = run_cli(plugins, train_args(tiny_model_dir, data, out, "--env", f"{tmp_path / 'tools.py'}:FlakyTool",
                                             "--async", "--max-staleness", "2", "--advantage", "recording_rloo",
                                             *(["--partial-rollouts", "--partial-chunk-tokens", "2"] if partial else [])))
        assert result.exit_code == 0, result.output
        runs.append(out)
        recorded.append(list(RECORDED))
    samples, metrics = read_jsonl(runs[0] / "samples.jsonl"), read_jsonl(runs[0] / "metrics.jsonl")
    # the rates count the samples as they ended (after their retries)
    assert sum(m["outcome/retries"] for m in metrics) > 0, "no sample failed: pick another seed"
    assert sum(m["outcome/dropped_groups"] for m in metrics) == 0  # a retry succeeded each time here
    assert all(s["outcome"] in ("ok", "truncated") for s in samples) and len(samples) == 18
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 2]
    if partial:  # every policy token, a retry's included, within the bound; versions recorded per token
        assert all(m["staleness/max"] <= 2 for m in metrics)
        assert all(sum(count for version, count in s["token_versions"] if version >= 0) > 0 for s in samples)
    for step, record in enumerate(recorded[0]):
        rewards = record["rewards"].view(2, 3).tolist()
        assert record["valid"].tolist() == [1.0] * 6
        assert rewards == [[s["reward"] for s in samples if s["step"] == step + 1][3 * g:3 * g + 3] for g in range(2)]
        for g in range(2):
            for i in range(3):
                got = record["advantages"][3 * g + i][record["action_mask"][3 * g + i].bool()]
                expected = rewards[g][i] - sum(rewards[g][j] for j in range(3) if j != i) / 2  # RLOO
                assert torch.allclose(got, torch.full_like(got, expected), atol=1e-6), (step, g, i)
    assert samples == read_jsonl(runs[1] / "samples.jsonl")
    untimed = [[{k: v for k, v in m.items() if not k.endswith("_s")} for m in comparable(read_jsonl(out / "metrics.jsonl"))]
               for out in runs]  # seconds (env/time_s, async/wait_s) are the machine's
    assert untimed[0] == untimed[1]
    assert all(torch.equal(a["advantages"], b["advantages"]) for a, b in zip(*recorded))
    first, second = final_weights(runs[0]), final_weights(runs[1])
    assert all(torch.equal(first[k], second[k]) for k in first)
