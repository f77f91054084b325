"""``--agent`` with ``--async --max-staleness K``: each generation lane's policy copy serves its
trajectories through an endpoint of its own, every model token records the version that sampled
it (samples.jsonl ``token_versions``, segments too), the staleness bound is checked on those
tokens, and the run is deterministic and exactly resumable with agent batches in flight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import final_weights, read_jsonl, run_cli, small_config

pytestmark = pytest.mark.run

pytest.importorskip("openai")

AGENTS = Path(__file__).with_name("agents.py")
TRAINING_KEYS = ("policy/loss", "policy/grad_norm", "reward/mean", "staleness/max", "staleness/mean",
                 "async/staleness_max", "agent/segments_mean", "agent/segment_rows")


def per_token(token_runs: list[list]) -> list:
    return [value for value, count in token_runs for _ in range(count)]


def _train(plugins, model, task, out, *extra: str):
    result = run_cli(plugins, [
        "train", "--algo", "grpo", "--model", str(model), "--data", str(task / "data.jsonl"), "--input-key",
        "prompt", "--agent", f"{AGENTS}:branches", "--n-samples", "2", "--prompts-per-step", "2",
        "--max-new-tokens", "4", "--steps", "4", "--out", str(out), "--seed", "3", "--no-progress", "--async",
        "--max-staleness", "2", "--lr", "1e-2", *extra])
    assert result.exit_code == 0, result.output
    return read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "samples.jsonl")


def test_an_async_agent_run_samples_each_batch_with_its_version_and_repeats_bit_for_bit(plugins, tiny_model_dir,
                                                                                       task, tmp_path, monkeypatch):
    from rlhf.runtime.rl.async_generation import AsyncGeneration

    gaps = {}
    behaviour = AsyncGeneration._behaviour

    def compared(self, rolled, lane, version):
        """The engine's log-probs of what the lane's endpoint sampled against its copy's (version ``version``)."""
        out = behaviour(self, rolled, lane, version)
        gaps[rolled.step] = float(((out - rolled.batch.rollout_logprobs).abs() * rolled.batch.action_mask).max())
        return out

    monkeypatch.setattr(AsyncGeneration, "_behaviour", compared)
    # (the engine's log-probs recorded for the mismatch correction; they depend on which requests share a
    # decode step, up to float rounding, so the bit-for-bit runs below leave them out)
    _train(plugins, tiny_model_dir, task, tmp_path / "tis", "--policy-loss.correction", "tis")
    # the requests of a lane's trajectories went to that lane's copy: at temperature 1 the engine's
    # log-probs are the copy's, whose weights are 2 versions behind the trainer's from step 3 on
    assert sorted(gaps) == [0, 1, 2, 3] and max(gaps.values()) < 1e-5, gaps
    monkeypatch.undo()
    metrics, samples = _train(plugins, tiny_model_dir, task, tmp_path / "a")
    # batch j is sampled by version max(0, j - 2): staleness 0, 1, 2, 2, checked on every model token
    assert [m["staleness/max"] for m in metrics] == [0.0, 1.0, 2.0, 2.0]
    assert [m["staleness/mean"] for m in metrics] == [0.0, 1.0, 2.0, 2.0]
    assert [m["agent/segment_rows"] for m in metrics] == [4.0] * 4 and all(m["agent/failure_rate"] == 0 for m in metrics)
    assert len(samples) == 16
    for sample in samples:
        step = sample["step"] - 1
        for row in (sample, *sample["segments"]):
            versions = per_token(row["token_versions"])
            model = [o == "model" for o in per_token(row["token_origins"])][-len(versions):]
            assert [v >= 0 for v in versions] == model and sum(model) == row["completion_tokens"] >= 1
            # every model token within K = 2 of the step that trains it: exactly the lane's version
            assert {v for v in versions if v >= 0} == {max(0, step - 2)}
    again_metrics, again = _train(plugins, tiny_model_dir, task, tmp_path / "b")
    assert again == samples
    assert [{k: m[k] for k in TRAINING_KEYS} for m in again_metrics] == [{k: m[k] for k in TRAINING_KEYS} for m in metrics]
    first, second = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_resume_with_agent_batches_in_flight_equals_the_uninterrupted_run(tiny_model_dir, task, tmp_path,
                                                                          make_plugin):
    """Batches made ahead (their trajectories, segments and the segments' behaviour log-probs) go into
    the checkpoint; the resumed run trains on them and ends where the uninterrupted one does."""
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.rl.local import train

    def config(out, **more):
        return small_config(tiny_model_dir, task, out, agent=f"{AGENTS}:branches", input_key="prompt", reward=[],
                            label_key=None, steps=5, save_every=2, async_rollout=True, max_staleness=2, **more)

    train(config(tmp_path / "whole"), plugins=build_plugin_manager())

    def crash(step):
        if step == 2:
            raise KeyboardInterrupt

    plugins = build_plugin_manager()
    plugins.register(make_plugin("killer", on_checkpoint=crash))
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "cut"), plugins=plugins)
    assert (tmp_path / "cut" / "checkpoints").exists()
    train(config(tmp_path / "cut", resume=True), plugins=build_plugin_manager())

    def comparable(rows):
        return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "async/wait", "async/idle"))
                 and "per_s" not in k} for row in rows]

    assert comparable(read_jsonl(tmp_path / "cut" / "metrics.jsonl")) == \
        comparable(read_jsonl(tmp_path / "whole" / "metrics.jsonl"))
    assert read_jsonl(tmp_path / "cut" / "samples.jsonl") == read_jsonl(tmp_path / "whole" / "samples.jsonl")
    got, expected = final_weights(tmp_path / "cut"), final_weights(tmp_path / "whole")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_at_staleness_zero_an_async_agent_run_is_the_synchronous_run(plugins, tiny_model_dir, task, tmp_path,
                                                                     monkeypatch):
    from rlhf.runtime.rl import async_generation

    recorded = []
    monkeypatch.setattr(async_generation, "record_behaviour", lambda *args: recorded.append(args))
    options = ["--steps", "3", "--max-staleness", "0"]
    async_metrics, async_samples = _train(plugins, tiny_model_dir, task, tmp_path / "async", *options)
    assert recorded == []  # the trainer's own forward gives the segments' old log-probs: the same weights
    result = run_cli(plugins, [
        "train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--input-key",
        "prompt", "--agent", f"{AGENTS}:branches", "--n-samples", "2", "--prompts-per-step", "2",
        "--max-new-tokens", "4", "--steps", "3", "--out", str(tmp_path / "sync"), "--seed", "3", "--no-progress",
        "--lr", "1e-2"])
    assert result.exit_code == 0, result.output
    assert read_jsonl(tmp_path / "sync" / "samples.jsonl") == async_samples
    keys = ("policy/loss", "policy/grad_norm", "reward/mean", "agent/segment_rows")
    assert [{k: m[k] for k in keys} for m in read_jsonl(tmp_path / "sync" / "metrics.jsonl")] == \
        [{k: m[k] for k in keys} for m in async_metrics]
    assert [m["staleness/max"] for m in async_metrics] == [0.0] * 3
    first, second = final_weights(tmp_path / "sync"), final_weights(tmp_path / "async")
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("policy", ["retry", "mask"])
def test_failed_agent_calls_under_async_leave_the_batch_or_stay_masked(plugins, tiny_model_dir, tmp_path, policy):
    """``fails_sometimes`` raises on the prompt "2+1=" every time: under ``retry`` (no retries with
    --async) its group leaves the batch, whose behaviour log-probs leave with it; under ``mask`` it
    stays, out of the loss and the baseline."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "2+1="}\n{"prompt": "3+1="}\n')
    out = tmp_path / "run"
    result = run_cli(plugins, [
        "train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", str(data), "--input-key", "prompt",
        "--agent", f"{AGENTS}:fails_sometimes", "--n-samples", "2", "--prompts-per-step", "2",
        "--max-new-tokens", "3", "--steps", "3", "--on-failure", policy, "--async", "--max-staleness", "1",
        "--out", str(out), "--seed", "3", "--no-progress"])
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(out / "metrics.jsonl")
    assert len(metrics) == 3 and all(m["outcome/agent_error_rate"] == 0.5 for m in metrics)
    samples = read_jsonl(out / "samples.jsonl")
    if policy == "retry":
        assert all(m["outcome/dropped_groups"] == 1 for m in metrics)
        assert len(samples) == 6 and all("3+1=" in s["prompt"] for s in samples)
    else:
        assert len(samples) == 12 and sum(s["outcome"] == "agent_error" for s in samples) == 6
