"""The fit loop's eval, ``--save-best`` and step order, end to end on the tiny model.

* Eval runs on ``--eval-data``, not the training set, on schedule and after the last step even
  when the step count is not a multiple of ``--eval-every``.
* ``--save-best``: a resumed run keeps the best of the run before it, and a NaN eval is never best.
* Every epoch is a new shuffle of the whole data, and a resumed run takes the same steps.

Evals whose values the test chooses come from ``scripted_sft``: SFT whose eval pass also reports
``quality``, the next value of a list the test sets (one eval pass = one micro-batch here).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

import rlhf
from rlhf.core.plugin_host.loading import PluginSet, build_plugin_manager
from rlhf.plugins.objectives.config import SFTConfig
from rlhf.plugins.objectives.sft import SFTObjective
from rlhf.runtime.config.fit_config import FitConfig
from rlhf.runtime.fit.data import _epoch_order
from rlhf.runtime.fit.local import fit
from tests.helpers import objective_scores, read_jsonl, run_cli, write_jsonl

pytestmark = pytest.mark.run

WORDS = ["cat", "hello world", "the quick brown fox", "12 + 7 = 19", "dog", "say hello", "jumps over", "lazy"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval-best-data")
    n = len(WORDS)
    write_jsonl(root / "sft.jsonl", [{"prompt": f"Q: {w}?", "response": f"{w} {w}"} for w in WORDS])
    write_jsonl(root / "sft_eval.jsonl", [{"prompt": "Q: eval?", "response": "one"},
                                          {"prompt": "Q: eval again?", "response": "two"}])
    write_jsonl(root / "pairs.jsonl", [{"prompt": f"Q: {w}?", "chosen": w, "rejected": WORDS[(i + 3) % n]}
                                       for i, w in enumerate(WORDS)])
    # eval pairs unlike any training pair: longer texts, another prompt, three rows
    write_jsonl(root / "pairs_eval.jsonl", [
        {"prompt": "Tell me a story about the sea.", "chosen": "Once upon a time a boat sailed far away.",
         "rejected": "no"},
        {"prompt": "Tell me a story about a dog.", "chosen": "A dog ran over the hill and home again.",
         "rejected": "maybe later"},
        {"prompt": "Count to five.", "chosen": "1 2 3 4 5", "rejected": "1 2 3"}])
    return root


# --- eval on --eval-data, on schedule -----------------------------------------------------------


@pytest.fixture(scope="module")
def rm_run(tiny_model_dir: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``rlhf rm``: 3 steps of 2 pairs (4 steps to an epoch), ``--eval-every 2``, eval on another file."""
    out = tmp_path_factory.mktemp("rm-eval") / "run"
    result = run_cli(build_plugin_manager(load_entrypoints=False), [
        "rm", "--model", str(tiny_model_dir), "--data", str(data / "pairs.jsonl"), "--eval-data",
        str(data / "pairs_eval.jsonl"), "--batch-size", "2", "--steps", "3", "--eval-every", "2", "--lr", "1e-2",
        "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    return out


def test_eval_runs_every_n_steps_and_after_a_last_step_off_the_schedule(rm_run):
    """Steps 1-3 with ``--eval-every 2``: eval after step 2 and after step 3, the last."""
    metrics = read_jsonl(rm_run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["step"] for m in metrics if "eval/loss" in m] == [2, 3]


def test_eval_scores_the_eval_data_not_the_training_data(rm_run, data):
    """The eval after the last step (final weights) reports the mean chosen / rejected scores of the
    eval pairs, as the objective scores them on the exported model; those of the training pairs differ."""
    last = read_jsonl(rm_run / "metrics.jsonl")[-1]
    on_eval = objective_scores(rm_run / "final", data / "pairs_eval.jsonl")  # 3 x (chosen, rejected)
    on_train = objective_scores(rm_run / "final", data / "pairs.jsonl")  # 8 x (chosen, rejected)
    for index, key in enumerate(("eval/chosen_score", "eval/rejected_score")):
        eval_mean = statistics.fmean(pair[index] for pair in on_eval)
        train_mean = statistics.fmean(pair[index] for pair in on_train)
        assert abs(eval_mean - train_mean) > 1e-3  # the two files tell apart
        assert last[key] == pytest.approx(eval_mean, abs=1e-5), key
    accuracy = statistics.fmean(float(c > r) for c, r in on_eval)
    assert last["eval/accuracy"] == pytest.approx(accuracy)


# --- --save-best with evals the test chooses --------------------------------------------------------


class ScriptedEvalSFT(SFTObjective):
    """SFT whose eval pass also reports ``quality``: the next value of ``script``. Training forwards
    run with grad, eval ones without: that tells them apart."""

    script: list[float] = []

    def loss(self, models, batch, stats):
        loss, metrics = super().loss(models, batch, stats)
        if not torch.is_grad_enabled():
            metrics["quality"] = ScriptedEvalSFT.script.pop(0)
        return loss, metrics


# With --save-best, the loop runs one eval forward before training to check that the eval reports
# the metric (a typo is a usage error before any step): it takes the script's first value.
PROBE = -1.0


def scripted_plugins(make_plugin, **hooks: Any) -> PluginSet:
    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(make_plugin("scripted_objective", register_objectives=lambda register: register(
        "scripted_sft", ScriptedEvalSFT, config_cls=SFTConfig, default_lr=1e-2)))
    if hooks:
        plugins.register(make_plugin("test_hooks", **hooks))
    return plugins


def scripted_config(model: Path, data: Path, out: Path, **extra: Any) -> FitConfig:
    """4 steps of 2 examples, eval (2 rows, one micro-batch) after each, best by ``quality``."""
    return FitConfig.from_dict({"model": str(model), "data": [str(data / "sft.jsonl")],
                                "eval_data": [str(data / "sft_eval.jsonl")], "objective": "scripted_sft",
                                "batch_size": 2, "micro_batch_size": 2, "steps": 4, "eval_every": 1,
                                "save_best": "eval/quality", "threads": 1, "out": str(out), "progress": False,
                                **extra})


def test_resume_keeps_the_best_of_the_interrupted_run(tiny_model_dir, data, tmp_path, make_plugin):
    """Evals 1, 5 (best, step 2), 0.5, then killed after step 3 (the checkpoint is step 2's); the
    resumed run's evals, 2 and 3, are worse than 5: best/ keeps step 2's weights and best.json."""
    out = tmp_path / "run"

    def kill_after_step_3(step):
        if step == 2:
            raise KeyboardInterrupt

    ScriptedEvalSFT.script = [PROBE, 1.0, 5.0, 0.5]
    plugins = scripted_plugins(make_plugin, on_step_end=rlhf.hookimpl(trylast=True)(kill_after_step_3))
    with pytest.raises(KeyboardInterrupt):
        fit(scripted_config(tiny_model_dir, data, out, save_every=1), plugins=plugins)
    assert ScriptedEvalSFT.script == []
    best_json = (out / "best" / "best.json").read_text()
    assert json.loads(best_json) == {"metric": "eval/quality", "value": 5.0, "step": 2}
    best_weights = (out / "best" / "model.safetensors").read_bytes()

    ScriptedEvalSFT.script = [PROBE, 2.0, 3.0]
    fit(scripted_config(tiny_model_dir, data, out, save_every=1, resume=True),
        plugins=scripted_plugins(make_plugin))
    assert ScriptedEvalSFT.script == []
    evals = {m["step"]: m["eval/quality"] for m in read_jsonl(out / "metrics.jsonl") if "eval/quality" in m}
    assert evals == {1: 1.0, 2: 5.0, 3: 2.0, 4: 3.0}
    assert (out / "best" / "best.json").read_text() == best_json
    assert (out / "best" / "model.safetensors").read_bytes() == best_weights
    assert (out / "final" / "model.safetensors").read_bytes() != best_weights  # training went on after step 2


def test_a_nan_eval_is_never_best(tiny_model_dir, data, tmp_path, make_plugin):
    """Evals NaN, 1, 0.5, NaN: no best/ after the NaN first eval; then step 2's is best and stays."""
    out = tmp_path / "run"
    best_exists: list[bool] = []

    def look_for_best(step):
        best_exists.append((out / "best").exists())

    ScriptedEvalSFT.script = [PROBE, math.nan, 1.0, 0.5, math.nan]
    fit(scripted_config(tiny_model_dir, data, out), plugins=scripted_plugins(make_plugin, on_step_end=look_for_best))
    assert ScriptedEvalSFT.script == []
    assert best_exists == [False, True, True, True]  # eval and --save-best run before on_step_end
    assert json.loads((out / "best" / "best.json").read_text()) == {"metric": "eval/quality", "value": 1.0,
                                                                    "step": 2}


# --- the step order ---------------------------------------------------------------------------------


class RecordingSFT(SFTObjective):
    """SFT that records the prompts of every optimizer step's examples (``step_examples``; the run
    has no eval data, so every call is a training step)."""

    steps: list[list[str]] = []

    def encode(self, row, text):
        return row["prompt"], super().encode(row, text)

    def step_examples(self, examples):
        RecordingSFT.steps.append([prompt for prompt, _ in examples])
        return examples

    def collate(self, examples, pad_token_id):
        return super().collate([example for _, example in examples], pad_token_id)


def test_each_epoch_is_a_new_shuffle_of_all_the_data_and_resume_takes_the_same_steps(
        tiny_model_dir, data, tmp_path, make_plugin):
    """3 epochs of 4 steps of 2 examples; then the same run killed after step 7 (mid-epoch 2) and
    resumed from its step-6 checkpoint."""

    def plugins_with(**hooks: Any) -> PluginSet:
        plugins = build_plugin_manager(load_entrypoints=False)
        plugins.register(make_plugin("recording_objective", register_objectives=lambda register: register(
            "recording_sft", RecordingSFT, config_cls=SFTConfig, default_lr=1e-3)))
        if hooks:
            plugins.register(make_plugin("test_hooks", **hooks))
        return plugins

    def config(out: Path, **extra: Any) -> FitConfig:
        _epoch_order.cache_clear()  # each run draws its orders afresh, as a new process would
        return FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(data / "sft.jsonl")],
                                    "objective": "recording_sft", "batch_size": 2, "micro_batch_size": 2,
                                    "epochs": 3, "save_every": 2, "threads": 1, "out": str(out), "progress": False,
                                    **extra})

    RecordingSFT.steps = []
    fit(config(tmp_path / "straight"), plugins=plugins_with())
    straight = RecordingSFT.steps
    assert len(straight) == 12 and all(len(step) == 2 for step in straight)
    epochs = [[prompt for step in straight[begin:begin + 4] for prompt in step] for begin in (0, 4, 8)]
    everything = sorted(f"Q: {w}?" for w in WORDS)
    assert all(sorted(epoch) == everything for epoch in epochs)  # each epoch: every example once
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]

    def kill_after_step_7(step):
        if step == 6:
            raise KeyboardInterrupt

    RecordingSFT.steps = []
    interrupted = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        fit(config(interrupted), plugins=plugins_with(on_step_end=rlhf.hookimpl(trylast=True)(kill_after_step_7)))
    assert RecordingSFT.steps == straight[:7]
    RecordingSFT.steps = []
    fit(config(interrupted, resume=True), plugins=plugins_with())
    assert RecordingSFT.steps == straight[6:]  # from the step-6 checkpoint: steps 7-12 as in the straight run


@pytest.mark.parametrize(("direction", "script"), [("max", [1.0, 2.0, 2.0, 0.5]), ("min", [2.0, 1.0, 1.0, 3.0])])
def test_a_tie_keeps_the_earlier_best(direction, script, tiny_model_dir, data, tmp_path, make_plugin):
    """Only a strictly better eval replaces best/: steps 2 and 3 tie, step 2 stays best."""
    out = tmp_path / "run"
    ScriptedEvalSFT.script = [PROBE, *script]
    fit(scripted_config(tiny_model_dir, data, out, save_best=f"eval/quality:{direction}"),
        plugins=scripted_plugins(make_plugin))
    assert ScriptedEvalSFT.script == []
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 2


def test_max_samples_takes_that_many_rows(tiny_model_dir, data, tmp_path):
    """--max-samples 4 of 8 rows, 2 a step: an epoch is 2 steps."""
    out = tmp_path / "run"
    result = run_cli(build_plugin_manager(load_entrypoints=False), [
        "sft", "--model", str(tiny_model_dir), "--data", str(data / "sft.jsonl"), "--max-samples", "4",
        "--batch-size", "2", "--steps", "1", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert read_jsonl(out / "metrics.jsonl")[0]["train/epoch"] == 0.5


def test_a_save_best_metric_the_eval_does_not_report_names_those_it_does(tiny_model_dir, data, tmp_path,
                                                                         make_plugin):
    from rlhf.core.errors import ConfigError

    ScriptedEvalSFT.script = [1.0] * 4
    with pytest.raises(ConfigError, match=r"--save-best eval/qualty: the eval reports no eval/qualty; it reports "
                                          r"eval/loss, eval/quality$"):
        fit(scripted_config(tiny_model_dir, data, tmp_path / "run", save_best="eval/qualty"),
            plugins=scripted_plugins(make_plugin))
    assert ScriptedEvalSFT.script == [1.0] * 3  # found by the check before training: one eval forward, no step
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_jsonl(tmp_path / "run" / "metrics.jsonl")
    ScriptedEvalSFT.script = [PROBE] + [1.0] * 4  # the corrected rerun on the same --out runs
    fit(scripted_config(tiny_model_dir, data, tmp_path / "run"), plugins=scripted_plugins(make_plugin))


class NaNOnCueSFT(SFTObjective):
    """SFT whose training loss is NaN on the steps listed in ``nan_steps`` (counted from 1)."""

    nan_steps: set[int] = set()
    calls = 0

    def step_examples(self, examples):
        NaNOnCueSFT.calls += 1
        return examples

    def loss(self, models, batch, stats):
        loss, metrics = super().loss(models, batch, stats)
        if NaNOnCueSFT.calls in NaNOnCueSFT.nan_steps:
            loss = loss * float("nan")
        return loss, metrics


def test_a_nan_loss_skips_the_step_and_too_many_in_a_row_stop_the_run(tiny_model_dir, data, tmp_path, make_plugin,
                                                                      caplog):
    from rlhf.core.errors import RlhfError

    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(make_plugin("nan_objective", register_objectives=lambda register: register(
        "nan_sft", NaNOnCueSFT, config_cls=SFTConfig, default_lr=1e-2)))
    NaNOnCueSFT.nan_steps, NaNOnCueSFT.calls = {1, 3, 4}, 0
    config = FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(data / "sft.jsonl")],
                                  "objective": "nan_sft", "batch_size": 2, "steps": 4, "max_nonfinite_steps": 2,
                                  "threads": 1, "out": str(tmp_path / "run"), "progress": False})
    with pytest.raises(RlhfError, match="NaN/inf for 2 optimizer steps in a row"):
        fit(config, plugins=plugins)
    assert "step 1: the loss or gradient was NaN/inf; the optimizer step was skipped" in caplog.text
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]  # the stopping step is not logged
    assert rows[0]["train/skipped_steps"] == 1.0 and math.isnan(float(rows[0]["train/loss"]))  # written as "nan"
    assert rows[1]["train/skipped_steps"] == 0.0 and math.isfinite(rows[1]["train/loss"])
