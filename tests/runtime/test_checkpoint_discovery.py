"""Which checkpoint is the latest when step numbers cross a power of ten (step_9, step_10, step_100):
by number, never by name, for every reader of the checkpoints folder (rlhf/runtime/run/checkpoint.py,
run_dir.py, lifecycle.py): the list, the latest, the intact one ``--resume`` loads, pruning, the
HF exports, "is the run complete", and the checkpoint an interrupted run names."""

from __future__ import annotations

import json
import shutil

import pytest

from rlhf.runtime.run import checkpoint
from rlhf.runtime.run.lifecycle import _complete, _interrupted
from rlhf.runtime.run.run_dir import RunDirectory

pytestmark = pytest.mark.unit

STEPS = [100, 9, 2, 10]  # written out of order


@pytest.fixture
def run(tmp_path):
    for step in STEPS:
        checkpoint.save_checkpoint(tmp_path, step, workers={}, trainer_state={"mark": step}, keep=0)
    root = tmp_path / "checkpoints"
    (root / "step_x").mkdir()  # not a step folder
    (root / "step_500").write_text("a file, not a folder")
    (root / ".step_1000.tmp").mkdir()  # a write a kill cut short
    return tmp_path


def names(paths):
    return [p.name for p in paths]


def test_checkpoints_are_ordered_by_their_step_number(run):
    assert names(checkpoint.list_checkpoints(run)) == ["step_2", "step_9", "step_10", "step_100"]
    assert checkpoint.latest_checkpoint(run).name == "step_100"
    assert checkpoint.intact_checkpoint(run).name == "step_100"


def test_resume_loads_the_highest_step(run):
    state = RunDirectory(run).resume({})
    assert (state["step"], state["mark"]) == (100, 100)


def test_a_damaged_latest_falls_back_to_the_next_lower_step_not_the_next_name(run):
    (run / "checkpoints" / "step_100" / "trainer_state.json").write_text("{}")  # no longer what the manifest says
    assert checkpoint.intact_checkpoint(run).name == "step_10"
    assert RunDirectory(run).resume({})["step"] == 10


def test_pruning_keeps_the_highest_steps(run):
    removed = checkpoint.prune(run, keep=2)
    assert sorted(names(removed)) == ["step_2", "step_9"]
    assert names(checkpoint.list_checkpoints(run)) == ["step_10", "step_100"]


def test_hf_exports_are_ordered_and_an_hf_only_folder_is_no_checkpoint(run):
    for step in (20, 3):
        checkpoint.save_hf_only(run, step, lambda folder: (folder / "hf").mkdir(), keep=0)
    for step in (9, 100):
        (run / "checkpoints" / f"step_{step}" / "hf").mkdir()
    assert names(checkpoint.list_hf_exports(run)) == ["step_3", "step_9", "step_20", "step_100"]
    assert checkpoint.latest_checkpoint(run).name == "step_100"
    shutil.rmtree(run / "checkpoints" / "step_100")
    assert checkpoint.latest_checkpoint(run).name == "step_10"  # step_20 holds HF exports only
    checkpoint.prune(run, keep=1)
    assert names(checkpoint.list_checkpoints(run)) == ["step_10"]
    assert names(checkpoint.list_hf_exports(run)) == ["step_20"]  # the newest HF-only export kept


@pytest.mark.parametrize("total,complete", [(100, True), (10, True), (101, False)])
def test_a_run_is_complete_by_its_highest_step(run, total, complete):
    (run / "final").mkdir()
    assert _complete(run, total) is complete


def test_an_interrupted_run_names_its_highest_checkpoint(run):
    message = str(_interrupted(RunDirectory(run), "train", 100, 200, "SIGINT"))
    assert f"the latest checkpoint is {run / 'checkpoints' / 'step_100'} (step 100)" in message


def test_a_resumed_run_keeps_the_replaced_config_under_the_highest_step(run):
    (run / "config.yaml").write_text("lr: 0.1\n")
    (run / "plugins.json").write_text("{}")  # with config.yaml: a run's directory (docs/runs.md)
    RunDirectory(run).prepare(config={"lr": 0.2}, plugins={}, resume=True)
    assert (run / "config.until_step_100.yaml").read_text() == "lr: 0.1\n"
    assert json.loads((run / "plugins.json").read_text()) == {}
