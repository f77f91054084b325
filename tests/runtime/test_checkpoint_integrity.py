"""Checkpoints and saved models end with a manifest (every file's size and SHA-256, written last);
``--resume`` checks the newest checkpoint against it and falls back to the newest intact one with
one warning naming the damaged file; a damaged file is one line, never a traceback; folders a
killed write left behind are removed when the next run starts (rlhf/runtime/run/checkpoint.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.run import checkpoint
from rlhf.runtime.rl.local import train
from tests.helpers import final_weights, run_cli, small_config


def _truncate(path, keep=100):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _weights_file(step_dir):
    return next(p for p in sorted(step_dir.rglob("*")) if p.is_file() and p.suffix in (".safetensors", ".pt")
                and p.stat().st_size > 1000)


@pytest.mark.run
def test_every_checkpoint_and_model_folder_has_a_manifest_of_its_files(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, steps=2, save_every=1), plugins=plugins)
    for folder in (out / "checkpoints" / "step_1", out / "checkpoints" / "step_2", out / "final"):
        manifest = json.loads((folder / checkpoint.MANIFEST).read_text())["files"]
        on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and p.name != checkpoint.MANIFEST}
        assert set(manifest) == on_disk and on_disk
        some = sorted(on_disk)[0]
        assert manifest[some]["bytes"] == (folder / some).stat().st_size
        assert len(manifest[some]["sha256"]) == 64
        assert checkpoint.manifest_problem(folder) is None


@pytest.mark.unit
def test_manifest_problem_names_the_file_and_what_changed(tmp_path):
    folder = tmp_path / "step_1"
    (folder / "policy").mkdir(parents=True)
    (folder / "policy" / "weights.pt").write_bytes(b"0123456789")
    (folder / "trainer_state.json").write_text("{}")
    checkpoint.write_manifest(folder)
    assert checkpoint.manifest_problem(folder) is None
    (folder / "policy" / "weights.pt").write_bytes(b"0123456780")  # same size, one byte changed
    assert checkpoint.manifest_problem(folder) == f"{folder / 'policy' / 'weights.pt'} differs from what was " \
                                                  "written (its SHA-256 changed)"
    (folder / "policy" / "weights.pt").write_bytes(b"01234")
    assert checkpoint.manifest_problem(folder) == f"{folder / 'policy' / 'weights.pt'} has 5 bytes where 10 were " \
                                                  "written"
    (folder / "policy" / "weights.pt").write_bytes(b"0123456789")
    (folder / "trainer_state.json").unlink()
    assert "trainer_state.json is missing" in checkpoint.manifest_problem(folder)
    (folder / checkpoint.MANIFEST).write_text("{not json")
    assert "MANIFEST.json cannot be read" in checkpoint.manifest_problem(folder)
    (folder / checkpoint.MANIFEST).unlink()
    assert checkpoint.manifest_problem(folder) is None  # written before manifests: nothing to check


@pytest.mark.run
def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before(tiny_model_dir, task, tmp_path, plugins, caplog):
    """Killed after step 3 with step_3 damaged: the resume warns once, continues from step_2 and ends
    with the uninterrupted run's weights."""
    whole = tmp_path / "whole"
    train(small_config(tiny_model_dir, task, whole, steps=4, save_every=1), plugins=plugins)
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, steps=3, save_every=1), plugins=plugins)
    damaged = _weights_file(out / "checkpoints" / "step_3")
    _truncate(damaged)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        train(small_config(tiny_model_dir, task, out, steps=4, save_every=1, resume=True, resume_override=["steps"]),
              plugins=build_plugin_manager())
    warnings = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warnings) == 1 and str(damaged) in warnings[0] and "resuming from step_2" in warnings[0]
    assert any("resumed from checkpoints/step_2" in r.getMessage() for r in caplog.records)
    got, expected = final_weights(out), final_weights(whole)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.run
def test_no_intact_checkpoint_is_one_line_through_the_cli(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, steps=1), plugins=plugins)
    damaged = _weights_file(out / "checkpoints" / "step_1")
    _truncate(damaged)
    result = run_cli(plugins, ["train", "--config", str(out / "config.yaml"), "--resume", "--steps", "2",
                               "--resume-override", "steps"])
    assert result.exit_code == 1
    assert "no intact checkpoint" in result.output and str(damaged) in result.output
    assert "Traceback" not in result.output


@pytest.mark.run
def test_a_damaged_checkpoint_from_before_manifests_is_one_line(tiny_model_dir, task, tmp_path, plugins):
    """No manifest to check (an older rlhf wrote it): the reader's failure names the folder."""
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, steps=1), plugins=plugins)
    step = out / "checkpoints" / "step_1"
    (step / checkpoint.MANIFEST).unlink()
    _truncate(_weights_file(step))
    with pytest.raises(RlhfError, match=f"cannot load the checkpoint {step}"):
        train(small_config(tiny_model_dir, task, out, steps=2, resume=True, resume_override=["steps"]),
              plugins=build_plugin_manager())


@pytest.mark.run
def test_leftovers_of_a_killed_write_are_removed_at_start(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, steps=1), plugins=plugins)
    leftovers = [out / "checkpoints" / ".step_2.tmp", out / ".final.tmp", out / "checkpoints" / ".step_1.old"]
    for folder in leftovers:
        folder.mkdir()
        (folder / "weights.pt").write_bytes(b"x" * 1000)
    train(small_config(tiny_model_dir, task, out, steps=2, resume=True, resume_override=["steps"]),
          plugins=build_plugin_manager())
    assert not any(folder.exists() for folder in leftovers)
    assert (out / "checkpoints" / "step_2").is_dir()


@pytest.fixture
def damaged_model(tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "damaged-model"
    shutil.copytree(tiny_model_dir, model)
    _truncate(model / "model.safetensors", keep=(model / "model.safetensors").stat().st_size // 2)
    return model


@pytest.mark.unit
@pytest.mark.parametrize("command", ["train", "chat", "sft"])
def test_a_damaged_model_file_is_one_line_naming_the_model(command, damaged_model, task, tmp_path, plugins):
    out = tmp_path / "run"
    args = {"train": ["train", "--model", str(damaged_model), "--data", str(task / "data.jsonl"), "--label-key",
                      "answer", "--reward", str(task / "rewards.py"), "--steps", "1", "--out", str(out)],
            "chat": ["chat", str(damaged_model)],
            "sft": ["sft", "--model", str(damaged_model), "--data", str(task / "data.jsonl"), "--input-key", "prompt",
                    "--output-key", "answer", "--steps", "1", "--out", str(out)]}[command]
    result = run_cli(plugins, args, input="")
    assert result.exit_code == 1, result.output
    assert f"cannot read the weights of {damaged_model}: a file there is damaged or incomplete" in result.output
    assert "Traceback" not in result.output and not out.exists()
