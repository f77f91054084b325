"""--async --partial-rollouts: trajectories move to newer weights mid-generation on a logical clock of
tokens; every token records its version (samples.jsonl ``token_versions``); no token is trained more
than K versions after the one that sampled it (checked on every token); K = 0 is the non-partial run;
runs repeat and resume bit for bit, trajectories in flight included, whatever the tools' timing."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.local import train
from rlhf.runtime.rl.offpolicy.schedule import StalenessError
from tests.helpers import final_weights, read_jsonl, small_config

pytestmark = pytest.mark.run

TRAINING_KEYS = ("reward/mean", "policy/loss", "policy/grad_norm", "policy/approx_kl", "response/length_mean")

# Tool calls of random duration (numbers of their own, never the run's): trajectories and batches
# end in a different order every run.
RANDOM_TOOLS = '''
import random, time
from rlhf.core.types import StepResult


class RandomTools:
    def reset(self, prompt, label):
        self.turns = 0
        return None

    def step(self, action):
        self.turns += 1
        time.sleep(random.Random().uniform(0.0, 0.05))
        return StepResult(observation=" ok", reward=float(len(action) % 3), done=self.turns >= 2)
'''


def _run(model, task, out, plugins=None, **overrides):
    train(small_config(model, task, out, **{"steps": 5, **overrides}), plugins=plugins or build_plugin_manager())
    return read_jsonl(out / "metrics.jsonl")


def _samples(out):
    return [(s["step"], s["completion"], s["reward"], s.get("token_versions")) for s in read_jsonl(out / "samples.jsonl")]


def _assert_same_run(out, metrics, expected_out, expected_metrics):
    assert [{k: m[k] for k in TRAINING_KEYS} for m in metrics] == \
        [{k: m[k] for k in TRAINING_KEYS} for m in expected_metrics]
    assert _samples(out) == _samples(expected_out)
    for (name, a), b in zip(final_weights(expected_out).items(), final_weights(out).values()):
        assert torch.equal(a, b), name


def first_token_over(samples: list[dict], max_staleness: int) -> tuple[int, int, int] | None:
    """The checker: the first (sample, token, version) of samples.jsonl trained more than K versions
    after its version (or sampled by a version the step cannot have yet); None when none is."""
    for row, sample in enumerate(samples):
        step = sample["step"] - 1  # samples.jsonl counts steps from 1
        token = 0
        for version, count in sample["token_versions"]:
            if version >= 0 and not step - max_staleness <= version <= step:
                return row, token, version
            token += count
    return None


def _options(tmp_path, name, **more):
    (tmp_path / f"{name}.py").write_text(RANDOM_TOOLS)
    return dict(async_rollout=True, max_staleness=2, partial_rollouts=True, partial_chunk_tokens=2,
                max_new_tokens=4, max_turns=2, reward=[], env=f"{tmp_path / name}.py:RandomTools", save_every=2,
                **more)


def test_multi_turn_partial_rollouts_switch_versions_within_the_bound_and_repeat_bit_for_bit(
        tiny_model_dir, task, tmp_path):
    first = _run(tiny_model_dir, task, tmp_path / "a", **_options(tmp_path, "tools_a"))
    samples = read_jsonl(tmp_path / "a" / "samples.jsonl")
    assert first_token_over(samples, 2) is None
    assert first_token_over(samples, 0) is not None  # the checker sees stale tokens when they are there
    # token_versions covers every completion token, policy (version >= 0) and environment (-1) alike
    for sample in samples:
        assert all(count > 0 for _, count in sample["token_versions"])
    # trajectories moved to newer weights mid-generation: some hold tokens of two versions
    mixed = [s for s in samples if len({v for v, _ in s["token_versions"] if v >= 0}) > 1]
    assert mixed, samples
    assert all(m["staleness/max"] <= 2 for m in first)
    assert [m["staleness/max"] for m in first][:3] == [0, 1, 2]  # the bound is reached, never passed
    assert all(0 < m["staleness/mean"] <= m["staleness/max"] for m in first[1:])
    assert any(m["staleness/mean"] < m["staleness/max"] for m in first[2:])  # newer tokens lower the mean
    # how long the batch's rollout waited for a version (the first batch has only version 0: none)
    assert first[0]["time/version_wait"] == 0.0 and all(m["time/version_wait"] >= 0.0 for m in first)
    second = _run(tiny_model_dir, task, tmp_path / "b", **_options(tmp_path, "tools_b"))
    _assert_same_run(tmp_path / "b", second, tmp_path / "a", first)


def test_resume_with_partial_rollouts_in_flight_equals_the_uninterrupted_run(tiny_model_dir, task, tmp_path,
                                                                             make_plugin):
    first = _run(tiny_model_dir, task, tmp_path / "a", **_options(tmp_path, "tools_a"))

    def crash(step):
        if step == 2:
            raise KeyboardInterrupt

    plugins = build_plugin_manager()
    plugins.register(make_plugin("killer", on_checkpoint=crash))
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_model_dir, task, tmp_path / "c", plugins=plugins, **_options(tmp_path, "tools_c"))
    # the bound holds across the resume: with a smaller K the checkpoint's in-flight batches are refused
    with pytest.raises(StalenessError, match="of step 3's batch was sampled by version 0, 2 versions before.*--max-staleness 1.*resume "
                                             "with the --max-staleness the run was started with"):
        _run(tiny_model_dir, task, tmp_path / "c", resume=True, resume_override=["max_staleness"],
             **{**_options(tmp_path, "tools_c"), "max_staleness": 1})
    # (the refused resume recorded K = 1 as the run's option: back to 2 the same way)
    resumed = _run(tiny_model_dir, task, tmp_path / "c", resume=True, resume_override=["max_staleness"],
                   **_options(tmp_path, "tools_c"))
    _assert_same_run(tmp_path / "c", resumed, tmp_path / "a", first)


def test_at_staleness_zero_partial_rollouts_are_the_plain_run(tiny_model_dir, task, tmp_path):
    options = dict(_options(tmp_path, "tools"), max_staleness=0, steps=3)
    partial = _run(tiny_model_dir, task, tmp_path / "a", **options)
    plain = _run(tiny_model_dir, task, tmp_path / "b", **{**options, "partial_rollouts": False})
    assert [{k: m[k] for k in TRAINING_KEYS} for m in partial] == [{k: m[k] for k in TRAINING_KEYS} for m in plain]
    assert [s[:3] for s in _samples(tmp_path / "a")] == [s[:3] for s in _samples(tmp_path / "b")]
    for (name, a), b in zip(final_weights(tmp_path / "a").items(), final_weights(tmp_path / "b").values()):
        assert torch.equal(a, b), name
    assert all(m["staleness/max"] == 0 for m in partial)


def test_single_turn_partial_rollouts(tiny_model_dir, task, tmp_path):
    metrics = _run(tiny_model_dir, task, tmp_path / "a", async_rollout=True, max_staleness=2, partial_rollouts=True,
                   partial_chunk_tokens=2, max_new_tokens=6)
    samples = read_jsonl(tmp_path / "a" / "samples.jsonl")
    assert first_token_over(samples, 2) is None
    assert any(len({v for v, _ in s["token_versions"]}) > 1 for s in samples)
    assert all(m["staleness/max"] <= 2 for m in metrics)


def test_sigterm_between_scheduled_checkpoints_keeps_the_last_one_and_resume_equals_the_run(
        tiny_model_dir, task, tmp_path, make_plugin):
    """A stop after step 3 (checkpoints every 2 steps): batches in flight then may wait for versions
    after step 3, so no checkpoint is written there; --resume goes on from step 2's, to the same end."""
    import os
    import signal

    from rlhf.core.errors import RunInterrupted

    first = _run(tiny_model_dir, task, tmp_path / "a", **_options(tmp_path, "tools_a"))

    def on_step_end(step):
        if step == 2:  # mid-run, the third step
            os.kill(os.getpid(), signal.SIGTERM)

    plugins = build_plugin_manager()
    plugins.register(make_plugin("stopper", on_step_end=on_step_end))
    with pytest.raises(RunInterrupted):
        _run(tiny_model_dir, task, tmp_path / "c", plugins=plugins, **_options(tmp_path, "tools_c"))
    assert sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_2"]
    resumed = _run(tiny_model_dir, task, tmp_path / "c", resume=True, **_options(tmp_path, "tools_c"))
    _assert_same_run(tmp_path / "c", resumed, tmp_path / "a", first)


def test_an_engine_that_does_not_batch_continuously_is_refused_before_the_run_starts(tiny_model_dir, task,
                                                                                    tmp_path):
    from rlhf.core.errors import RlhfError

    with pytest.raises(RlhfError, match="--partial-rollouts needs an engine that batches continuously"):
        _run(tiny_model_dir, task, tmp_path / "a", engine_config=["continuous=false"],
             **_options(tmp_path, "tools_a"))
    assert not (tmp_path / "a" / "metrics.jsonl").exists()  # not a step ran
