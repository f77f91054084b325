"""The agent rollout: each trajectory one agent call (sync or async) through its own endpoint, a
failed call (raised, timed out, NaN, no reward to give) a failed trajectory with its outcome and
error and nothing to train, and ``rlhf train --agent FILE.py:fn`` end to end through the CLI."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from rlhf.core.protocols.agent import AgentConfig
from rlhf.core.plugin_host.references import import_object
from rlhf.plugins.tool_parsers.hermes import parse
from rlhf.runtime.agents.calling import AgentCaller
from rlhf.runtime.agents.endpoint import AgentEndpoint
from rlhf.runtime.agents.requests import RunSampling
from rlhf.runtime.agents.rollout import AgentRollout, AgentSettings
from tests.helpers import prompt_item, read_jsonl, run_cli

pytestmark = pytest.mark.run

pytest.importorskip("openai")

AGENTS = Path(__file__).with_name("agents.py")


@pytest.fixture(scope="module")
def engine_and_tokenizer(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.plugins.engines.hf import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return HFEngine(model, tokenizer), tokenizer


def roll(engine_and_tokenizer, agent: str, prompts: list[str], *, timeout_s: float = 60.0, n: int = 1,
         has_reward_sources: bool = False, policy_version: int | None = None):
    engine, tokenizer = engine_and_tokenizer
    run = RunSampling(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=6,
                      max_total_tokens=200)
    endpoint = AgentEndpoint(engine, tokenizer, parse, run, model_name="policy", continuous=True)
    caller = AgentCaller(import_object(f"{AGENTS}:{agent}"), AgentConfig(timeout_s=timeout_s), agent)
    rollout = AgentRollout(endpoint, caller, tokenizer, AgentSettings(name=agent, input_key="prompt",
                                                                     has_reward_sources=has_reward_sources))
    items = [prompt_item(tokenizer, text, label=None) for text in prompts]
    try:
        return asyncio.run(rollout.run(items, n, rollout_seed=7, logprobs=True,
                                       policy_version=policy_version)), endpoint
    finally:
        endpoint.stop()


def test_each_sample_is_one_call_and_its_tokens_train(engine_and_tokenizer):
    trajectories, _ = roll(engine_and_tokenizer, "solve", ["1+2=", "3+4="], n=2)
    assert [t.group for t in trajectories] == [0, 0, 1, 1]
    for t in trajectories:
        assert t.outcome == "ok" and t.error is None
        assert t.info["agent_requests"] == 2 and t.info["agent_segments"] == 1 and t.num_turns == 2
        assert t.info["env_reward"] in (0.0, 1.0, 2.0) and t.info["agent_info"] == {"turns": 2}
        assert 2 <= sum(t.loss_mask) <= 8 and len(t.rollout_logprobs) == len(t.token_ids) == len(t.loss_mask)
        assert t.loss_mask[t.prompt_length] == 1 and not any(t.loss_mask[:t.prompt_length])
        assert all(lp < 0 for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m)


def test_an_async_agent_runs_on_the_rollouts_loop(engine_and_tokenizer):
    trajectories, _ = roll(engine_and_tokenizer, "solve_async", ["1+2=", "3+4="])
    assert all(t.outcome == "ok" and t.info["agent_requests"] == 1 for t in trajectories)


def test_failed_calls_are_failed_trajectories_with_nothing_to_train(engine_and_tokenizer):
    trajectories, endpoint = roll(engine_and_tokenizer, "fails_sometimes", ["2+1=", "5+1=", "7+1=", "9+1="],
                                  timeout_s=3.0)
    raised, hung, nan, fine = trajectories
    assert raised.outcome == "agent_error" and raised.error == "ValueError: the tool crashed on 2"
    assert hung.outcome == "timeout" and "--agent.timeout-s (3 s)" in hung.error
    assert nan.outcome == "agent_error" and "not a finite number" in nan.error
    assert fine.outcome == "ok" and fine.error is None and fine.info["env_reward"] == 1.0
    for failed in (raised, hung, nan):
        assert not any(failed.loss_mask) and failed.info["env_reward"] == 0.0
        assert failed.info["agent_requests"] == 1  # what it sampled is kept for the record, masked
    assert sum(fine.loss_mask) > 0
    assert endpoint.open_trajectories == {}  # every trajectory's endpoint closed, the hung one's too


def test_an_async_agent_that_hangs_times_out(engine_and_tokenizer):
    (trajectory,), _ = roll(engine_and_tokenizer, "hangs", ["1+1="], timeout_s=0.5)
    assert trajectory.outcome == "timeout" and not any(trajectory.loss_mask)
    assert trajectory.token_ids[-1] == engine_and_tokenizer[1].eos_token_id  # the prompt and an EOS, no request


def test_no_reward_without_reward_sources_is_a_failure(engine_and_tokenizer, tmp_path):
    none_agent = tmp_path / "none_agent.py"
    none_agent.write_text("def solve(sample, endpoint):\n    return None\n")
    engine, tokenizer = engine_and_tokenizer
    run = RunSampling(1.0, 1.0, 0, 1.0, 4, 100)
    endpoint = AgentEndpoint(engine, tokenizer, parse, run, model_name="policy", continuous=True)
    caller = AgentCaller(import_object(f"{none_agent}:solve"), AgentConfig(), "none")
    items = [prompt_item(tokenizer, "1+1=", label=None)]
    for has_sources, outcome in ((False, "agent_error"), (True, "ok")):
        rollout = AgentRollout(endpoint, caller, tokenizer, AgentSettings("none", "prompt", has_sources))
        (trajectory,) = asyncio.run(rollout.run(items, 1, 1, logprobs=False))
        assert trajectory.outcome == outcome and trajectory.rollout_logprobs is None
    endpoint.stop()


def test_rlhf_train_with_an_agent_by_reference(plugins, tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    result = run_cli(plugins, [
        "train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
        "--input-key", "prompt", "--agent", f"{AGENTS}:solve", "--agent.timeout-s", "120", "--n-samples", "2",
        "--prompts-per-step", "2", "--max-new-tokens", "4", "--steps", "2", "--out", str(out), "--seed", "3",
        "--no-progress"])
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(out / "metrics.jsonl")
    assert len(metrics) == 2
    for row in metrics:
        assert row["agent/segments_mean"] == 1.0 and row["agent/requests_mean"] == 2.0
        # a random model's text need not render back to its tokens (special tokens, broken UTF-8): spliced
        assert row["agent/failure_rate"] == 0.0 and 0.0 <= row["agent/drift_rate"] <= 1.0
        assert math.isfinite(row["policy/grad_norm"])
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 8 and all(s["reward"] in (0.0, 1.0, 2.0) for s in samples)
    for sample in samples:  # where each token came from, as [origin, count] runs
        origins = dict.fromkeys(o for o, _ in sample["token_origins"])
        assert {"template", "user", "model"} <= set(origins)
        assert sum(c for o, c in sample["token_origins"] if o == "model") == sample["completion_tokens"]
    config = (out / "config.yaml").read_text()
    assert "agents.py:solve" in config and "timeout_s: 120" in config


def test_agent_options_that_cannot_work_are_refused(plugins, tiny_model_dir, task, tmp_path):
    result = run_cli(plugins, [
        "train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--agent", f"{AGENTS}:solve",
        "--async", "--partial-rollouts", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "--agent with --partial-rollouts is not supported yet" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    result = run_cli(plugins, [
        "train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--agent", f"{AGENTS}:solve",
        "--env", "tir", "--out", str(tmp_path / "run")])
    # by design, not for now: the agent is the environment
    assert result.exit_code == 2 and "--agent replaces the environment" in result.output, result.output
    assert "drop --env tir" in result.output and "not supported" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_on_policy_distillation_of_an_agent_scores_every_sequence_with_the_teacher(plugins, tiny_model_dir, task,
                                                                                  tmp_path):
    out = tmp_path / "run"
    result = run_cli(plugins, [
        "train", "--algo", "opd", "--teacher", str(tiny_model_dir), "--model", str(tiny_model_dir), "--data",
        str(task / "data.jsonl"), "--input-key", "prompt", "--agent", f"{AGENTS}:branches", "--n-samples", "2",
        "--prompts-per-step", "2", "--max-new-tokens", "4", "--steps", "2", "--out", str(out), "--seed", "3",
        "--no-progress"])
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [row["agent/segment_rows"] for row in metrics] == [4.0, 4.0]
    assert all(math.isfinite(row["policy/grad_norm"]) for row in metrics)


def test_the_same_rollout_seed_samples_the_same_trajectories(engine_and_tokenizer):
    first, _ = roll(engine_and_tokenizer, "solve", ["1+2=", "3+4="], n=2)
    again, _ = roll(engine_and_tokenizer, "solve", ["1+2=", "3+4="], n=2)
    assert [t.token_ids for t in first] == [t.token_ids for t in again]
    assert len({tuple(t.token_ids) for t in first}) > 1  # each trajectory's requests have seeds of their own


def test_eval_runs_the_agent_on_held_out_rows(plugins, tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    result = run_cli(plugins, [
        "train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
        "--eval-data", str(task / "data.jsonl"), "--eval-max-samples", "2", "--eval-every", "1",
        "--input-key", "prompt", "--agent", f"{AGENTS}:solve_async", "--n-samples", "2", "--prompts-per-step", "2",
        "--max-new-tokens", "4", "--steps", "1", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    evals = [row for row in read_jsonl(out / "metrics.jsonl") if any(k.startswith("eval/") for k in row)]
    assert evals and evals[-1]["eval/prompts"] == 2.0


def test_sixty_four_agents_at_once_each_recorded_on_its_own(engine_and_tokenizer):
    prompts = [f"{a}+{b}=" for a in range(4) for b in range(4)]
    trajectories, endpoint = roll(engine_and_tokenizer, "solve_async", prompts, n=4)
    assert len(trajectories) == 64 and [t.group for t in trajectories] == [g for g in range(16) for _ in range(4)]
    assert all(t.outcome == "ok" and t.info["agent_requests"] == 1 and t.info["agent_segments"] == 1
               for t in trajectories)
    tokenizer = engine_and_tokenizer[1]
    for t, prompt in zip(trajectories, [p for p in prompts for _ in range(4)]):
        assert prompt in tokenizer.decode(t.token_ids[:t.prompt_length])  # each endpoint recorded its own agent
        assert 1 <= sum(t.loss_mask) <= 4


def test_ctrl_c_during_agent_calls_checkpoints_and_resume_ends_as_an_uninterrupted_run(
        plugins, tiny_model_dir, task, tmp_path, monkeypatch):
    import torch

    from rlhf.runtime.rl.local import train
    from rlhf.core.errors import RunInterrupted
    from tests.helpers import final_weights, small_config

    def config(out, **changes):
        return small_config(tiny_model_dir, task, out, agent=f"{AGENTS}:signals_once", steps=3, **changes)

    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    whole = train(config(tmp_path / "whole"), plugins=plugins)
    (tmp_path / "calls").unlink()
    monkeypatch.setenv("SIGNAL_ON_CALL", "5")  # the first agent call of step 2 (4 calls per step)
    out = tmp_path / "stopped"
    with pytest.raises(RunInterrupted, match=r"after step 2/3"):
        train(config(out), plugins=plugins)
    monkeypatch.setenv("SIGNAL_ON_CALL", "0")
    train(config(out, resume=True), plugins=plugins)

    def comparable(rows):
        return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and "per_s" not in k}
                for row in rows]

    assert comparable(read_jsonl(out / "metrics.jsonl")) == comparable(read_jsonl(whole / "metrics.jsonl"))
    got, expected = final_weights(out), final_weights(whole)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def per_token(token_runs: list[list]) -> list:
    return [value for value, count in token_runs for _ in range(count)]


def test_a_branched_trajectory_trains_every_sequence_with_the_policy_version_of_each_token(engine_and_tokenizer):
    trajectories, _ = roll(engine_and_tokenizer, "branches", ["1+2=", "3+4="], n=2, policy_version=4)
    for t in trajectories:
        assert t.outcome == "ok" and t.info["agent_segments"] == 2 and len(t.segments) == 1
        (segment,) = t.segments
        assert segment.group == t.group and "(summary)" in t.prompt_text and "(summary)" not in segment.prompt_text
        for row in (t, segment):
            assert sum(row.loss_mask) >= 1 and len(row.rollout_logprobs) == len(row.token_ids)
            origins, versions = per_token(row.info["agent_token_origins"]), row.token_versions
            assert len(origins) == len(versions) == len(row.token_ids)
            assert [v == 4 for v in versions] == [o == "model" for o in origins] == [m == 1 for m in row.loss_mask]
            assert set(versions) == {-1, 4}


def test_rlhf_train_trains_the_segments_and_writes_each_tokens_policy_version(plugins, tiny_model_dir, task,
                                                                              tmp_path):
    out = tmp_path / "run"
    result = run_cli(plugins, [
        "train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
        "--input-key", "prompt", "--agent", f"{AGENTS}:branches", "--n-samples", "2", "--prompts-per-step", "2",
        "--max-new-tokens", "4", "--steps", "2", "--out", str(out), "--seed", "3", "--no-progress"])
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [row["agent/segments_mean"] for row in metrics] == [2.0, 2.0]
    assert [row["agent/segment_rows"] for row in metrics] == [4.0, 4.0]  # a row each, trained beside the 4
    assert all(math.isfinite(row["policy/grad_norm"]) for row in metrics)
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 8
    for sample in samples:
        (segment,) = sample["segments"]
        for row in (sample, segment):
            # token_versions covers the completion (from the first model token): the tail of token_origins
            versions = per_token(row["token_versions"])
            model = [o == "model" for o in per_token(row["token_origins"])][-len(versions):]
            assert [v >= 0 for v in versions] == model and sum(model) == row["completion_tokens"] >= 1
            assert versions[0] >= 0 and "policy_versions" not in row
            assert {v for v in versions if v >= 0} == {sample["step"] - 1}  # the weights after step - 1 steps


@pytest.mark.parametrize("policy", ["retry", "mask"])
def test_a_failing_agent_call_goes_through_the_failure_policy(plugins, tiny_model_dir, tmp_path, policy):
    """``fails_sometimes`` raises on a prompt whose first number is even, every time: under ``retry``
    its samples are drawn again (``--max-retries`` times each), then its group leaves the batch;
    under ``mask`` they stay, recorded with their outcome and error, out of the baseline."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "2+1="}\n{"prompt": "3+1="}\n')
    out = tmp_path / "run"
    result = run_cli(plugins, [
        "train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", str(data), "--input-key", "prompt",
        "--agent", f"{AGENTS}:fails_sometimes", "--n-samples", "2", "--prompts-per-step", "2",
        "--max-new-tokens", "3", "--steps", "1", "--on-failure", policy, "--max-retries", "2", "--out", str(out),
        "--seed", "3", "--no-progress"])
    assert result.exit_code == 0, result.output
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert metrics["outcome/agent_error_rate"] > 0
    samples = read_jsonl(out / "samples.jsonl")
    if policy == "retry":
        assert metrics["outcome/retries"] == 4 and metrics["outcome/dropped_groups"] == 1
        assert ["3+1=" in s["prompt"] for s in samples] == [True, True]
    else:
        failed = [s for s in samples if s["outcome"] == "agent_error"]
        assert len(failed) == 2 and len(samples) == 4
        assert all(s["error"].startswith("ValueError: the tool crashed on 2") for s in failed)
