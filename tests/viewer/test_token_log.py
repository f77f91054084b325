"""tokens.jsonl (rlhf/runtime/rl/token_log.py): what a training run records per token of its first
``--log-tokens N`` samples a step, that it lines up with samples.jsonl and the step's math, that
``--resume`` cuts it back like the other logs (no step twice), and that ``rlhf view`` serves it.
A plain GRPO run (no old log-probs, no engine log-probs for its loss) records both log-prob
columns all the same, and training is bit for bit what it is without tokens.jsonl."""

from __future__ import annotations

import json
import math
import statistics
import types

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


# --- a plain GRPO run: the columns tokens.jsonl computes or asks for itself -----------------------


def _plain_run(tiny_model_dir, task, out, log_tokens):
    """Three steps of plain GRPO (one pass, KL in the loss: no old log-probs are computed; no mismatch
    correction: the loss reads no engine log-probs), and the trajectories each step scored."""
    import rlhf

    seen: dict[int, list[tuple[list[int], int, list[float] | None]]] = {}
    watcher = types.ModuleType("watcher")
    watcher.on_rewards = rlhf.hookimpl(lambda step, trajectories: seen.setdefault(step, [
        (list(t.token_ids), t.prompt_length, list(t.rollout_logprobs) if t.rollout_logprobs is not None else None)
        for t in trajectories]))
    plugins = build_plugin_manager()
    plugins.register(watcher)
    train(small_config(tiny_model_dir, task, out, steps=3, log_tokens=log_tokens, max_new_tokens=6),
          plugins=plugins)
    return seen


@pytest.fixture(scope="module")
def plain(tiny_model_dir, task, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "run"
    return out, _plain_run(tiny_model_dir, task, out, log_tokens=4)


# A record's floats keep 4 decimals: they are within half a unit of the 4th decimal of the value.
ROUNDING = 0.5e-4


def test_a_plain_grpo_run_records_the_policy_s_and_the_rollout_s_log_probs(plain):
    out, seen = plain
    records = read_jsonl(out / "tokens.jsonl")
    assert [(r["step"], r["sample"]) for r in records] == [(s, i) for s in (1, 2, 3) for i in range(4)]
    for record in records:
        n = len(record["ids"])
        assert len(record["logprobs"]) == n and len(record["rollout_logprobs"]) == n
        assert all(v is not None and v <= 0 for v, m in zip(record["logprobs"], record["mask"]) if m)
        assert "kl" not in record  # KL in the loss: the step computed no KL before the update (nor old log-probs)


def test_the_logged_policy_log_probs_are_the_starting_model_s_at_step_1(plain, tiny_model_dir):
    """Step 1 logs the log-probs before any update: a direct forward of the starting model on the
    same tokens (one row, no padding, temperature 1) gives them."""
    import torch
    from transformers import AutoModelForCausalLM

    out, seen = plain
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    records = [r for r in read_jsonl(out / "tokens.jsonl") if r["step"] == 1]
    for record, (token_ids, start, _) in zip(records, seen[0]):
        assert token_ids[start:] == record["ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()  # (T, V)
        direct = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]  # (T-1,)
        for j, (logged, m) in enumerate(zip(record["logprobs"], record["mask"])):
            if m:  # token start + j, predicted at position start + j - 1
                assert abs(logged - float(direct[start + j - 1])) <= ROUNDING + 1e-5, (record["sample"], j)


def test_the_logged_rollout_log_probs_are_the_engine_s_and_agree_with_the_policy_s_at_step_1(plain):
    """The hf engine samples with the policy's own weights: at step 1 its log-probs are the
    policy's up to the numerics of a cached decode (within 1e-4 here)."""
    out, seen = plain
    records = read_jsonl(out / "tokens.jsonl")
    for record in records:
        token_ids, start, rollout = seen[record["step"] - 1][record["sample"]]
        assert rollout is not None and len(rollout) == len(token_ids)
        assert record["rollout_logprobs"] == [round(v, 4) for v in rollout[start:]]
        assert all(v == 0.0 for v, m in zip(record["rollout_logprobs"], record["mask"]) if not m)
        if record["step"] == 1:
            for policy, engine, m in zip(record["logprobs"], record["rollout_logprobs"], record["mask"]):
                if m:
                    assert abs(policy - engine) <= 1e-4 + 2 * ROUNDING, (policy, engine)


def test_logging_tokens_leaves_training_bit_for_bit_as_it_was(plain, tiny_model_dir, task, tmp_path):
    """The extra forward (eval mode, no gradients, no random draws) and the engine's log-probs
    (which the update does not see) change nothing: the same final weights and metrics."""
    import torch

    from tests.helpers import final_weights

    out, _ = plain
    without = tmp_path / "run"
    _plain_run(tiny_model_dir, task, without, log_tokens=0)
    assert not (without / "tokens.jsonl").exists()
    logged, bare = final_weights(out), final_weights(without)
    assert logged.keys() == bare.keys()
    assert all(torch.equal(logged[k], bare[k]) for k in logged)

    def metrics(run):  # all but the clock's (time/*, and throughput/*: tokens per second of them)
        return [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))}
                for m in read_jsonl(run / "metrics.jsonl")]

    assert not any(isinstance(v, float) and math.isnan(v) for m in metrics(out) for v in m.values())
    assert metrics(out) == metrics(without) and len(metrics(out)) == 3
