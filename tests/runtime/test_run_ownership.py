"""A run owns its files, and only those (rlhf/runtime/run/run_files.py, docs/runs.md): an --out
of other files is refused before anything is written, files beside a run survive its resume and
clean-up, a run from before run manifests still resumes, damaged checkpoints are set aside so that
pruning always keeps an intact one (even with kills at any moment), and a full disk is one line
naming the file and the space needed, the partial write removed."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhf.core.errors import ConfigError, NoSpaceError, RlhfError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.run import checkpoint
from rlhf.runtime.run.run_dir import TRAINING, RunDirectory
from rlhf.runtime.run.run_files import RUN_MANIFEST, RunFiles, check_not_foreign
from tests.helpers import read_jsonl, run_cli

pytestmark = pytest.mark.run


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes (folders as None)."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def train_args(model, data, out, *extra):
    return ["train", "--model", str(model), "--data", str(data), "--label-key", "answer", "--reward", "exact_match",
            "--n-samples", "2", "--prompts-per-step", "2", "--max-new-tokens", "2", "--micro-batch-size", "2",
            "--out", str(out), "--no-progress", *extra]


def sft_args(model, data, out, *extra):
    return ["sft", "--model", str(model), "--data", str(data), "--batch-size", "2", "--out", str(out),
            "--no-progress", *extra]


def command_args(command, tiny_model_dir, task, fit_data, out, *extra):
    if command == "train":
        return train_args(tiny_model_dir, task / "data.jsonl", out, *extra)
    return sft_args(tiny_model_dir, fit_data / "sft.jsonl", out, *extra)


def intact(out: Path) -> list[str]:
    found = checkpoint.list_checkpoints(out)
    return [p.name for p in found if checkpoint.checkpoint_problem(p, found) is None]


# --- 1. an --out of other files ---------------------------------------------------------------


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_an_out_of_other_files_is_refused_before_anything_is_written(command, resume, tiny_model_dir, task, fit_data,
                                                                      tmp_path, plugins):
    """The probe's case: ``--data mydata/train.jsonl --out mydata --resume`` truncated every .jsonl there."""
    data = tmp_path / "mydata"
    data.mkdir()
    shutil.copy(task / "data.jsonl" if command == "train" else fit_data / "sft.jsonl", data / "train.jsonl")
    (data / "notes.jsonl").write_text('{"mine": 1}\n')
    before = snapshot(data)
    args = train_args(tiny_model_dir, data / "train.jsonl", data, "--steps", "1") if command == "train" else \
        sft_args(tiny_model_dir, data / "train.jsonl", data, "--steps", "1")
    result = run_cli(plugins, [*args, *(["--resume"] if resume else [])])
    assert result.exit_code == 2, result.output
    assert f"--out {data} is not empty and holds no run (notes.jsonl, train.jsonl)" in result.output
    assert "Traceback" not in result.output and [line[:7] for line in result.output.splitlines()
                                                 if "no run" in line] == ["Error: "]
    assert snapshot(data) == before  # not a byte: no lock file, no probe, no manifest


def test_an_iterate_out_of_other_files_is_refused_and_so_is_a_run_of_another_kind(tmp_path, plugins):
    from rlhf.datagen.iterate import ITERATION

    data = tmp_path / "mydata"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    before = snapshot(data)
    result = run_cli(plugins, ["iterate", "--model", str(tmp_path / "m"), "--data", str(data / "train.jsonl"),
                               "--reward", "exact_match", "--label-key", "answer", "--out", str(data)])
    assert result.exit_code == 2 and f"--out {data} is not empty and holds no run" in result.output, result.output
    assert snapshot(data) == before
    training = tmp_path / "training-run"
    RunFiles.open(training, TRAINING)
    with pytest.raises(ConfigError, match="is not empty and holds no run"):
        check_not_foreign(training, ITERATION)  # a training run's folder is no iterate run
    check_not_foreign(tmp_path / "absent", ITERATION)


# --- files beside a run -----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "sft"])
def test_files_beside_a_run_survive_its_resume(command, tiny_model_dir, task, fit_data, tmp_path, plugins):
    """``rlhf generate --out <run>/gen_step_1.jsonl``, a note, folders named like a write's leftovers:
    the run's resume cuts its own logs back and leaves all of them alone."""
    out = tmp_path / "run"
    args = command_args(command, tiny_model_dir, task, fit_data, out, "--save-every", "1")
    assert run_cli(plugins, [*args, "--steps", "1"]).exit_code == 0
    generated = run_cli(build_plugin_manager(load_entrypoints=False), [
        "generate", "--model", str(out / "final"), "--data", str(task / "data.jsonl"), "--n-samples", "1",
        "--max-new-tokens", "2", "--out", str(out / "gen_step_1.jsonl"), "--no-progress"])
    assert generated.exit_code == 0, generated.output
    (out / "notes.txt").write_text("mine")
    (out / "extra.jsonl").write_text('{"step": 7}\n{"step": 8}\n')  # named like a log: not the run's
    (out / ".scratch.tmp").mkdir()
    (out / ".scratch.tmp" / "x").write_text("mine")
    (out / ".notes.txt.tmp").write_text("mine")
    (out / "checkpoints" / "mine.txt").write_text("mine")
    beside = {k: v for k, v in snapshot(out).items()
              if k.split("/")[0] in ("gen_step_1.jsonl", "gen_step_1.jsonl.progress.jsonl", "notes.txt",
                                     "extra.jsonl", ".scratch.tmp", ".notes.txt.tmp") or k == "checkpoints/mine.txt"}
    assert len(beside) == 8 and beside["gen_step_1.jsonl"]
    resumed = run_cli(build_plugin_manager(load_entrypoints=False),
                      [*args, "--steps", "3", "--resume", "--resume-override", "steps", "--keep-checkpoints", "1"])
    assert resumed.exit_code == 0, resumed.output
    assert {k: v for k, v in snapshot(out).items() if k in beside} == beside
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]  # the run's log: cut, logged on
    owned = json.loads((out / RUN_MANIFEST).read_text())
    assert owned["kind"] == "training" and "metrics.jsonl" in owned["logs"] and "extra.jsonl" not in owned["logs"]
    assert not set(owned["owned"]) & set(beside)
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step_3"]


def test_a_run_from_before_run_manifests_resumes_owning_its_known_files(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    args = train_args(tiny_model_dir, task / "data.jsonl", out, "--save-every", "1")
    assert run_cli(plugins, [*args, "--steps", "1"]).exit_code == 0
    (out / RUN_MANIFEST).unlink()  # as an rlhf before run manifests left it
    (out / "mine.jsonl").write_text('{"step": 5}\n')
    resumed = run_cli(build_plugin_manager(load_entrypoints=False),
                      [*args, "--steps", "2", "--resume", "--resume-override", "steps"])
    assert resumed.exit_code == 0, resumed.output
    assert (out / "mine.jsonl").read_text() == '{"step": 5}\n'
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    owned = json.loads((out / RUN_MANIFEST).read_text())  # written now, from the names runs wrote then
    assert {"config.yaml", "plugins.json", "metrics.jsonl", "samples.jsonl", "checkpoints", "final"} <= set(
        owned["owned"]) and "mine.jsonl" not in owned["owned"]


def test_a_run_that_never_checkpointed_resumes_from_zero_and_cuts_only_its_own_logs(tiny_model_dir, task, tmp_path,
                                                                                   plugins, make_plugin):
    def fail(run, step, metrics):
        if step == 1:
            raise RlhfError("stop after the first step's row")

    out = tmp_path / "run"
    args = train_args(tiny_model_dir, task / "data.jsonl", out, "--steps", "2")
    broken = build_plugin_manager(load_entrypoints=False)
    broken.register(make_plugin("stops", on_step_end=fail))
    assert run_cli(broken, args).exit_code == 1
    assert (out / "metrics.jsonl").read_text() and not checkpoint.list_checkpoints(out)
    (out / "gen.jsonl").write_text('{"mine": 1}\n')
    resumed = run_cli(build_plugin_manager(load_entrypoints=False), [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert (out / "gen.jsonl").read_text() == '{"mine": 1}\n'
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_clean_up_touches_only_the_runs_leftovers_and_puts_back_a_replaced_folder(tmp_path):
    """A kill between `replace_atomically`'s two renames leaves ``.final.old`` and no ``final/``: put back."""
    run = RunDirectory(tmp_path / "run")
    RunFiles.open(run.path, TRAINING).claim("config.yaml", "checkpoints", "final", "best")
    for name in (".final.old", ".best.tmp", ".mine.tmp", "checkpoints/.step_3.tmp", "checkpoints/.step_1.pruned",
                 "checkpoints/.mine.old"):
        (run.path / name).mkdir(parents=True)
        (run.path / name / "f").write_text(name)
    (run.path / ".config.yaml.tmp").write_text("half")
    cleaned = run.remove_leftovers()
    assert sorted(p.name for p in cleaned) == [".best.tmp", ".config.yaml.tmp", ".final.old", ".step_1.pruned",
                                               ".step_3.tmp"]
    assert (run.path / "final" / "f").read_text() == ".final.old"  # put back
    assert sorted(p.name for p in run.path.iterdir()) == [".mine.tmp", RUN_MANIFEST, "checkpoints", "final"]
    assert [p.name for p in (run.path / "checkpoints").iterdir()] == [".mine.old"]


# --- 2. damaged checkpoints and pruning --------------------------------------------------------


def test_damaged_checkpoints_are_set_aside_and_pruning_always_keeps_an_intact_one(tiny_model_dir, task, tmp_path,
                                                                                 plugins, make_plugin, caplog):
    """The probe's case: resumed past a damaged newest checkpoint with --keep-checkpoints 1, every
    checkpoint the run wrote (and the one it resumed from) was deleted while the damaged one stayed."""
    out = tmp_path / "run"
    args = train_args(tiny_model_dir, task / "data.jsonl", out)
    assert run_cli(plugins, [*args, "--steps", "4", "--save-every", "2"]).exit_code == 0
    weights = next(p for p in sorted((out / "checkpoints" / "step_4").rglob("*.pt")) if p.stat().st_size > 1000)
    weights.write_bytes(weights.read_bytes()[:100])
    seen = []
    probe = build_plugin_manager(load_entrypoints=False)
    probe.register(make_plugin("probe", on_checkpoint=lambda run, step, path: seen.append((step, intact(out)))))
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        result = run_cli(probe, [*args, "--steps", "6", "--save-every", "1", "--keep-checkpoints", "1", "--resume",
                                 "--resume-override", "steps"])
    assert result.exit_code == 0, result.output
    assert seen == [(3, ["step_3"]), (4, ["step_4"]), (5, ["step_5"]), (6, ["step_6"])]  # one intact, always
    assert "--resume: step_4 is damaged" in caplog.text and "resuming from step_2 instead" in caplog.text
    assert "Set aside as checkpoints/step_4.damaged" in caplog.text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_4.damaged", "step_6"]
    assert (out / "checkpoints" / "step_4.damaged" / weights.relative_to(out / "checkpoints" / "step_4")).stat(
    ).st_size == 100  # kept for whoever wants to look


def test_a_checkpoint_without_its_manifest_beside_ones_with_one_is_damaged(tmp_path, caplog):
    """A copy cut short before its MANIFEST.json is no checkpoint from before manifests."""
    for step in (1, 2, 3):
        folder = tmp_path / "checkpoints" / f"step_{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
        checkpoint.write_manifest(folder)
    (tmp_path / "checkpoints" / "step_3" / checkpoint.MANIFEST).unlink()
    (tmp_path / "checkpoints" / "step_1" / "trainer_state.json").write_text("{}")  # an older one lost bytes
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        assert checkpoint.intact_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_2"
    assert "step_3 is damaged" in caplog.text and "MANIFEST.json is missing" in caplog.text
    assert "the older checkpoint step_1 is damaged" in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1.damaged", "step_2",
                                                                            "step_3.damaged"]
    for folder in (tmp_path / "checkpoints").iterdir():  # without any manifest: checkpoints of an older rlhf
        (folder / checkpoint.MANIFEST).unlink(missing_ok=True)
    assert checkpoint.intact_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_2"


KILLER = textwrap.dedent("""
    import os, shutil, sys

    budget = int(sys.argv[1])
    calls = 0

    def counted(original):
        def call(*args, **kwargs):
            global calls
            calls += 1
            if calls == budget:
                os._exit(137)  # killed here, half way through whatever the run was doing
            return original(*args, **kwargs)
        return call

    for name in ("rename", "replace", "unlink", "rmdir", "remove"):
        setattr(os, name, counted(getattr(os, name)))
    from rlhf.cli.main import main

    sys.argv = ["rlhf", *sys.argv[2:]]
    try:
        main()
    finally:
        print("CALLS", calls, file=sys.stderr)
""")


def test_kills_at_random_moments_with_keep_1_always_leave_an_intact_checkpoint(tiny_model_dir, task, tmp_path):
    """Each run is killed at a random file-system change (a rename, a removal: the moments pruning
    and replacing happen), then resumed; once a checkpoint exists, one intact checkpoint always does."""
    out = tmp_path / "run"
    args = train_args(tiny_model_dir, task / "data.jsonl", out, "--steps", "6", "--save-every", "1",
                      "--keep-checkpoints", "1", "--resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHF_LOAD_PLUGINS": "",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    rng = random.Random(int(os.environ.get("RLHF_KILL_SEED", "1234")))
    ever = False
    for attempt in range(6):
        budget = rng.randint(1, 40) if attempt < 5 else 10 ** 9  # the last one runs to the end
        done = subprocess.run([sys.executable, "-c", KILLER, str(budget), *args], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode in (0, 137), done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        now = intact(out)
        assert now or not ever, f"attempt {attempt} (killed at call {budget}): no intact checkpoint left"
        assert now == [p.name for p in checkpoint.list_checkpoints(out)], \
            f"attempt {attempt} (killed at call {budget}): a half-removed checkpoint passes for one"
        ever = ever or bool(now)
    assert done.returncode == 0 and intact(out) == ["step_6"]
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


# --- 3. a full disk ---------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for one checkpoint of the tiny model, not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or 'mount failed'}): the ENOSPC "
                    "tests without one cover the messages")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_one_before(tiny_model_dir, task, small_disk,
                                                                            plugins):
    out = small_disk / "run"
    result = run_cli(plugins, train_args(tiny_model_dir, task / "data.jsonl", out, "--steps", "3", "--save-every",
                                         "1"))
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert f"cannot write {out / 'checkpoints' / 'step_2'}" in lines[0]
    assert "No space left on device (" in lines[0] and "free there); it needs about 2.0 MiB" in lines[0], lines[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]  # no .step_2.tmp
    assert intact(out) == ["step_1"]


def test_a_full_disk_in_a_model_export_removes_the_partial_folder(tmp_path):
    """safetensors says it in its own words (an ``IoError`` of code 28); the final/ before is kept."""
    class SafetensorError(Exception):
        pass

    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()

    def write(folder: Path, fail: bool) -> None:
        (folder / "model.safetensors").write_bytes(b"x" * 300_000)
        if fail:
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })')

    run.write_model(run.final, lambda folder: write(folder, False))
    with pytest.raises(NoSpaceError) as caught:
        run.write_model(run.final, lambda folder: write(folder, True))
    assert str(caught.value).startswith(f"cannot write {run.final}: No space left on device (")
    assert "it needs about 0.3 MiB" in str(caught.value)
    assert sorted(p.name for p in run.path.iterdir()) == ["final"]  # no .final.tmp
    assert checkpoint.manifest_problem(run.final) is None


def test_a_full_disk_in_a_generated_file_cuts_it_back_and_names_the_space_needed(tmp_path, monkeypatch):
    import errno

    from rlhf.datagen import output

    out = output.ResumableJsonl(tmp_path / "gen.jsonl", {"seed": 1})
    out.append([{"prompt": "a"}], 1)
    before = (tmp_path / "gen.jsonl").read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(output.os, "fsync", full)  # where a network file system reports it
    with pytest.raises(NoSpaceError, match=rf"cannot write {tmp_path / 'gen.jsonl'}: No space left on device "
                                           r"\(.* free there\); it needs 17 bytes"):
        out.append([{"prompt": "bb"}], 1)
    assert (tmp_path / "gen.jsonl").read_bytes() == before


def test_a_full_disk_in_a_log_names_the_space_a_row_needs(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    from rlhf.core.types import RunInfo
    from rlhf.plugins.loggers.plugin import _append, _close

    run = RunInfo(config={}, out_dir=tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    try:
        with pytest.raises(NoSpaceError, match=rf"cannot write {tmp_path / 'metrics.jsonl'}: No space left on "
                                               r"device \(.*\); it needs 12 bytes"):
            _append(run, "metrics.jsonl", {"step": 1})
    finally:
        _close(run)
