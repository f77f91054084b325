"""tokens.jsonl (rlhf/runtime/rl/token_log.py): what a training run records per token of its first
``--log-tokens N`` samples a step, that it lines up with samples.jsonl and the step's math, that
``--resume`` cuts it back like the other logs (no step twice), and that ``rlhf view`` serves it."""

from __future__ import annotations

import json
import statistics

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.local import train
from rlhf.runtime.rl.token_log import expand, runs
from rlhf.viewer.runs import open_runs
from tests.helpers import read_jsonl, small_config

pytestmark = pytest.mark.run


def test_runs_and_expand_are_inverse():
    values = ["template", "template", "model", "tool", "tool", "model"]
    assert runs(values) == [["template", 2], ["model", 1], ["tool", 2], ["model", 1]]
    assert expand(runs(values)) == values and runs([]) == [] and expand([]) == []


@pytest.fixture(scope="module")
def run(tiny_model_dir, task, tmp_path_factory):
    """3 steps of 2 prompts x 2 samples, with KL to a reference and two passes (so every column is computed)."""
    out = tmp_path_factory.mktemp("tokens") / "run"
    train(small_config(tiny_model_dir, task, out, steps=3, save_every=1, log_tokens=3, kl_coef=0.1, ppo_epochs=2),
          plugins=build_plugin_manager())
    return out


def test_a_run_records_the_tokens_of_its_first_samples_each_step(run):
    records = read_jsonl(run / "tokens.jsonl")
    samples = read_jsonl(run / "samples.jsonl")
    assert [(r["step"], r["sample"]) for r in records] == [(s, i) for s in (1, 2, 3) for i in range(3)]
    manifest = json.loads((run / ".rlhf-run.json").read_text())
    assert "tokens.jsonl" in manifest["owned"] and "tokens.jsonl" in manifest["logs"]  # cut back on --resume
    for record in records:
        sample = [s for s in samples if s["step"] == record["step"]][record["sample"]]
        n = len(record["ids"])
        assert record["group"] == sample["group"] and sum(record["mask"]) == sample["completion_tokens"]
        for column in ("pieces", "mask", "logprobs", "advantages", "kl"):
            assert len(record[column]) == n, column
        assert expand(record["origins"]) == ["model" if m else "env" for m in record["mask"]]
        assert all(v is not None and v <= 0 for v, m in zip(record["logprobs"], record["mask"]) if m)
        assert "".join(record["pieces"]).startswith(sample["completion"][:3])
        if "rollout_logprobs" in record:
            assert len(record["rollout_logprobs"]) == n


def test_the_advantages_are_the_step_s_grpo_advantages(run):
    """GRPO's default (the preset's): (r - mean of the group) / (std of the group + eps), on every policy token."""
    records = read_jsonl(run / "tokens.jsonl")
    samples = read_jsonl(run / "samples.jsonl")
    for record in records:
        step_rows = [s for s in samples if s["step"] == record["step"]]
        group = [s["reward"] for s in step_rows if s["group"] == record["group"]]
        reward = step_rows[record["sample"]]["reward"]
        std = statistics.stdev(group) if len(group) > 1 else 0.0
        expected = (reward - statistics.mean(group)) / (std + 1e-6)
        values = {round(a, 3) for a, m in zip(record["advantages"], record["mask"]) if m}
        assert values == {round(expected, 3)} or values == {0.0} and std == 0.0, (values, expected)


def test_resume_cuts_tokens_back_to_the_checkpoint_so_no_step_appears_twice(run, tiny_model_dir, task, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run, out)
    shutil.rmtree(out / "checkpoints" / "step_3")  # killed after step 3's rows were written, before its checkpoint
    shutil.rmtree(out / "final")
    train(small_config(tiny_model_dir, task, out, steps=4, save_every=1, log_tokens=3, kl_coef=0.1, ppo_epochs=2,
                       resume=True, resume_override=["steps"]), plugins=build_plugin_manager())
    steps = [(r["step"], r["sample"]) for r in read_jsonl(out / "tokens.jsonl")]
    assert steps == [(s, i) for s in (1, 2, 3, 4) for i in range(3)]


def test_the_viewer_serves_a_real_run_s_tokens(run):
    [opened] = open_runs([run])
    assert opened.steps() == [1, 2, 3]
    step = opened.step(2)
    assert len(step["samples"]) == 4 and sorted(step["tokens"]) == ["0", "1", "2"]
    assert step["tokens"]["1"]["ids"] == read_jsonl(run / "tokens.jsonl")[4]["ids"]
