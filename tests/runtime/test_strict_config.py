"""Strict, hashed configuration (docs/runs.md, rlhf/runtime/config/identity.py): an unknown key is
refused wherever options are given (a ``--config`` file, ``--*-config KEY=VALUE``, component
settings) in one line suggesting the closest name, exit 2; every checkpoint's manifest records the
run's identity (the resolved configuration's hash, plugin versions, data fingerprints, data
cursor), and ``--resume`` refuses what changed unless ``--resume-override`` names it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import yaml

from rlhf.core.errors import ConfigError
from rlhf.runtime.config import identity
from rlhf.runtime.config.identity import data_fingerprints, identity_changes, run_identity
from rlhf.runtime.run.run_dir import RESUME_FREE, RunDirectory
from tests.helpers import run_cli

def train_args(model, task, out, *extra):
    return ["train", "--model", str(model), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(task / "rewards.py"), "--prompts-per-step", "2", "--n-samples", "2",
            "--max-new-tokens", "3", "--micro-batch-size", "2", "--lr", "1e-3", "--out", str(out), "--no-progress",
            *extra]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error")]


# --- unknown keys -----------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("how, extra, expected", [
    ("config", {"lrr": 0.1}, "unknown option(s) lrr; did you mean lr?"),
    ("config", {"components": {"backend": {"zero_stag": 3}}}, "backend.zero_stag; did you mean backend.zero_stage?"),
    ("config", {"reward_on_erorr": "skip"}, "reward_on_erorr; did you mean reward_on_error?"),
    ("flag", ["--algo-config", "clip_hihg=0.3"], "has an option clip_hihg;"),
    ("flag", ["--engine-config", "generation_batch_sze=2"], "has no option generation_batch_sze"),
    ("flag", ["--env-config", "timeout_z=5"], "no environment has an option timeout_z"),  # was dropped silently
    ("flag", ["--backend.zero-stag", "3"], "No such option '--backend.zero-stag'"),
])
def test_an_unknown_key_is_one_line_naming_it_and_the_closest(tiny_model_dir, task, tmp_path, plugins, how, extra,
                                                               expected):
    out = tmp_path / "run"
    if how == "config":
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(extra))
        extra = ["--config", str(tmp_path / "c.yaml")]
    result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "1", *extra))
    assert result.exit_code == 2, result.output
    lines = error_lines(result.output)
    assert len(lines) == 1 and expected in lines[0], result.output
    if how == "flag" and "--backend" not in extra[0]:
        assert lines[0].endswith("?"), lines[0]  # the suggestion: timeout_s, clip_high, generation_batch_size
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.unit
def test_a_config_dict_with_an_unknown_key_suggests_the_closest(plugins):
    from rlhf.runtime.config.train_config import TrainConfig

    with pytest.raises(ConfigError, match=r"unknown config key\(s\): prompts_per_stp; did you mean prompts_per_step\?"):
        TrainConfig.from_dict({"model": "m", "prompts_per_stp": 2}, plugins)


# --- the identity a checkpoint records ------------------------------------------------------------------


def fake_checkpoint(out: Path, step: int, run: dict | None) -> Path:
    folder = out / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    (folder / "MANIFEST.json").write_text(json.dumps({"files": {}, **({"run": run} if run is not None else {})}))
    return folder


def identity_of(tmp_path: Path, *, lr=0.001, plugins=None) -> dict:
    config = {"lr": lr, "data": [str(tmp_path / "d.jsonl")], "save_every": 1, "components": {"backend": {"x": 1}}}
    return run_identity(config, plugins or {"p": "rlhf-core==0.1.0"}, RESUME_FREE)


@pytest.mark.unit
def test_a_changed_plugin_version_or_option_is_refused_unless_overridden(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a"}\n')
    out = tmp_path / "run"
    fake_checkpoint(out, 3, {**identity_of(tmp_path), "cursor": {"step": 3, "loader": {"epoch": 0, "position": 6}}})
    run_dir = RunDirectory(out)
    run_dir.check_identity(identity_of(tmp_path), [])  # nothing changed
    with pytest.raises(ConfigError) as refused:
        run_dir.check_identity(identity_of(tmp_path, plugins={"p": "rlhf-core==0.2.0"}), [])
    message = str(refused.value)
    assert "\n" not in message and "plugin p: rlhf-core==0.1.0 -> rlhf-core==0.2.0" in message
    assert "--resume-override plugins" in message and "epoch 0, prompt 6" in message
    run_dir.check_identity(identity_of(tmp_path, plugins={"p": "rlhf-core==0.2.0"}), ["plugins"])
    with pytest.raises(ConfigError, match=r"checkpoints/step_3 was written with other options \(lr: 0.001 -> 0.01;"):
        run_dir.check_identity(identity_of(tmp_path, lr=0.01), [])  # e.g. a config.yaml edited by hand
    run_dir.check_identity(identity_of(tmp_path, lr=0.01), ["lr"])
    # a plugin added (or removed) is a warning where the run's plugin set is compared (lifecycle), not here
    assert identity_changes(identity_of(tmp_path), identity_of(tmp_path, plugins={"p": "rlhf-core==0.1.0",
                                                                                   "q": "x==1"})) == {}
    assert identity_of(tmp_path)["config_sha256"] != identity_of(tmp_path, lr=0.01)["config_sha256"]
    assert identity_of(tmp_path)["config_sha256"] == run_identity(
        {"lr": 0.001, "data": [str(tmp_path / "d.jsonl")], "save_every": 5, "progress": False,
         "components": {"backend": {"x": 1}}}, {"p": "rlhf-core==0.1.0"}, RESUME_FREE)["config_sha256"]


@pytest.mark.unit
def test_a_checkpoint_from_before_identities_resumes_with_one_warning(tmp_path, caplog):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a"}\n')
    out = tmp_path / "run"
    fake_checkpoint(out, 2, None)
    with caplog.at_level(logging.WARNING):
        RunDirectory(out).check_identity(identity_of(tmp_path, lr=5.0), [])
    assert caplog.text.count("was written before checkpoints recorded") == 1


@pytest.mark.unit
def test_a_changed_data_file_is_caught_by_its_fingerprint(tmp_path, monkeypatch):
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_text('{"prompt": "a"}\n' * 10)
    big.write_bytes(b"x" * 4000)
    monkeypatch.setattr(identity, "FULL_HASH_BYTES", 1000)
    monkeypatch.setattr(identity, "EDGE_BYTES", 100)
    before = data_fingerprints([str(small), str(big), "some/hub-dataset"])
    assert set(before) == {str(small), str(big)}  # a hub name is no local file
    assert before[str(small)]["hashed"] == "whole" and before[str(big)]["hashed"] == "ends"

    def changes(now):
        return identity_changes({"data": before}, {"data": now}).get("data", [])

    stamp = before[str(small)]["mtime_ns"] + 5_000_000_000
    os.utime(small, ns=(stamp, stamp))  # touched or copied: the same data, hashed whole
    assert changes(data_fingerprints([str(small), str(big)])) == []
    small.write_text('{"prompt": "b"}\n' * 10)  # same size, other content
    assert changes(data_fingerprints([str(small)])) == [f"{small} changed (same size, other content: its SHA-256 "
                                                        "differs)"]
    big.write_bytes(b"x" * 2000 + b"y" + b"x" * 1999)  # a change in the middle, ends alike: the mtime tells
    os.utime(big, ns=(stamp, stamp))
    assert any("only its ends are hashed" in line for line in changes(data_fingerprints([str(big)])))
    big.write_bytes(b"x" * 4001)
    assert any("4,000 bytes -> 4,001" in line for line in changes(data_fingerprints([str(big)])))
    folder = tmp_path / "saved"  # a save_to_disk folder: file by file
    folder.mkdir()
    (folder / "a.arrow").write_bytes(b"1" * 10)
    before = data_fingerprints([str(folder)])
    (folder / "a.arrow").write_bytes(b"2" * 10)
    (folder / "b.arrow").write_bytes(b"3")
    assert changes(data_fingerprints([str(folder)])) == [f"{folder}/b.arrow is new", f"{folder}/a.arrow changed (same "
                                                         "size, other content: its SHA-256 differs)"]


# --- through the CLI ------------------------------------------------------------------------------------


@pytest.mark.run
def test_resume_refuses_a_data_file_changed_under_the_same_path(tiny_model_dir, task, tmp_path, plugins, caplog):
    mine = tmp_path / "task"
    mine.mkdir()
    for name in ("data.jsonl", "rewards.py"):
        (mine / name).write_text((task / name).read_text())
    data = mine / "data.jsonl"

    def args(*extra):
        return train_args(tiny_model_dir, mine, tmp_path / "run", "--save-every", "1", *extra)

    assert run_cli(plugins, args("--steps", "1")).exit_code == 0
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "MANIFEST.json").read_text())
    recorded = manifest["run"]
    assert len(recorded["config_sha256"]) == 64 and recorded["config"]["lr"] == 0.001
    assert recorded["plugins"]["rlhf.plugins.algorithms.plugin"].startswith("rlhf-core==")
    assert recorded["data"][str(data)]["bytes"] == data.stat().st_size
    assert recorded["cursor"] == {"step": 1, "loader": {"epoch": 0, "position": 2}}
    assert "save_every" not in recorded["config"]  # options a resume may change are not part of the hash

    data.write_text(data.read_text().replace("What is 0 + 0?", "What is 9 + 9?"))  # same path, other rows
    refused = run_cli(plugins, args("--steps", "2", "--resume", "--resume-override", "steps"))
    assert refused.exit_code == 2, refused.output
    lines = error_lines(refused.output)
    assert len(lines) == 1 and f"{data} changed" in lines[0] and "--resume-override data" in lines[0], refused.output
    assert not (tmp_path / "run" / "checkpoints" / "step_2").exists()
    assert not (tmp_path / "run" / ".rlhf-lock").exists()  # the lock goes with the refusal

    resumed = run_cli(plugins, args("--steps", "2", "--resume", "--resume-override", "steps", "--resume-override",
                                    "data"))
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from checkpoints/step_1" in caplog.text and f"{data} changed" in caplog.text
    newest = json.loads((tmp_path / "run" / "checkpoints" / "step_2" / "MANIFEST.json").read_text())["run"]
    assert newest["data"][str(data)]["sha256"] != recorded["data"][str(data)]["sha256"]


@pytest.mark.unit
@pytest.mark.parametrize("text", ["lr: " + "[" * 5000 + "]" * 5000, "lr: " + "{a: " * 3000 + "1" + "}" * 3000,
                                  "lr:\n" + "".join("  " * (i + 1) + "a:\n" for i in range(3000)) + "  " * 3001 + "1"])
def test_a_config_nested_thousands_deep_is_one_line(tiny_model_dir, task, tmp_path, plugins, text):
    """PyYAML composes recursively: such a file was a RecursionError traceback, exit 1."""
    (tmp_path / "c.yaml").write_text(text + "\n")
    result = run_cli(plugins, train_args(tiny_model_dir, task, tmp_path / "run", "--config", str(tmp_path / "c.yaml")))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output[-500:]
    (line,) = error_lines(result.output)
    assert "values nested more than 100 levels deep" in line
    result = run_cli(plugins, train_args(tiny_model_dir, task, tmp_path / "run", "--algo-config",
                                         "clip_high=" + "[" * 5000 + "]" * 5000))
    (line,) = error_lines(result.output)
    assert result.exit_code == 2 and "nested more than 100 levels" in line and len(line) < 300, line[:300]


@pytest.mark.unit
def test_an_unknown_dpo_config_key_stops_iterate_before_any_round_samples(tiny_model_dir, task, tmp_path, plugins):
    """It used to be found by round 1's DPO run, after round 1's generation."""
    out = tmp_path / "idpo"
    result = run_cli(plugins, ["iterate", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--reward", str(task / "rewards.py"), "--n", "2", "--max-new-tokens", "3", "--rounds",
                               "1", "--out", str(out), "--no-progress", "--dpo-config", "lable_smoothing=0.1"])
    assert result.exit_code == 2, result.output
    (line,) = error_lines(result.output)
    assert "has no option lable_smoothing" in line and line.endswith("did you mean label_smoothing?")
    assert not out.exists()


@pytest.mark.run
def test_a_checkpoint_without_an_identity_still_resumes_through_the_cli(tiny_model_dir, task, tmp_path, plugins,
                                                                        caplog):
    out = tmp_path / "run"
    assert run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "1", "--save-every", "1")).exit_code == 0
    manifest = out / "checkpoints" / "step_1" / "MANIFEST.json"
    written = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({"files": written["files"]}))  # as an rlhf from before identities wrote it
    with caplog.at_level(logging.WARNING):
        result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "2", "--save-every", "1",
                                             "--resume", "--resume-override", "steps"))
    assert result.exit_code == 0, result.output
    assert caplog.text.count("was written before checkpoints recorded") == 1
    assert "resumed from checkpoints/step_1" in caplog.text
    assert "run" in json.loads((out / "checkpoints" / "step_2" / "MANIFEST.json").read_text())
