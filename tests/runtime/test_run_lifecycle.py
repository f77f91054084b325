"""The run directory's lifecycle, shared by `rlhf train` and the fit commands (rlhf/runtime/run/lifecycle.py):
checkpoints load no pickled code, --resume refuses changed options unless --resume-override names
them, Ctrl-C and SIGTERM write a checkpoint and print the resume command, final/ appears whole or
not at all, a run that failed at start is no run, and a full disk names the file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.run import checkpoint
from rlhf.runtime.rl.local import train
from rlhf.runtime.run.run_dir import RunDirectory
from tests.helpers import read_jsonl, run_cli, small_config


def train_args(model, task, out, *extra):
    return ["train", "--model", str(model), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(task / "rewards.py"), "--prompts-per-step", "2", "--n-samples", "2",
            "--max-new-tokens", "3", "--micro-batch-size", "2", "--lr", "1e-3", "--out", str(out), "--no-progress",
            *extra]


class Payload:
    """Pickled, it calls ``open(marker, "w")`` when loaded: what a crafted checkpoint could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.run
def test_a_checkpoint_that_holds_code_is_refused_not_run(tiny_model_dir, task, tmp_path, plugins):
    import torch

    out = tmp_path / "run"
    train(small_config(tiny_model_dir, task, out, steps=1), plugins=plugins)
    marker = tmp_path / "pwned"
    torch.save({"nonfinite_in_a_row": Payload(marker)}, out / "checkpoints" / "step_1" / "policy" / "state.pt")
    checkpoint.write_manifest(out / "checkpoints" / "step_1")  # whoever planted it rewrote the manifest too
    with pytest.raises(RlhfError, match="state.pt holds more than tensors and plain data"):
        train(small_config(tiny_model_dir, task, out, steps=2, resume=True, resume_override=["steps"]),
              plugins=build_plugin_manager())  # a run to continue (a complete one loads nothing)
    assert not marker.exists()


@pytest.mark.run
def test_resume_refuses_changed_options_unless_overridden(tiny_model_dir, task, tmp_path, plugins, caplog):
    out = tmp_path / "run"
    assert run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "1")).exit_code == 0

    refused = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "2", "--lr", "1e-2", "--resume"))
    assert refused.exit_code == 2
    assert "lr: 0.001 -> 0.01" in refused.output and "--resume-override lr steps" in refused.output
    assert yaml.safe_load((out / "config.yaml").read_text())["lr"] == 1e-3  # untouched

    result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "2", "--lr", "1e-2", "--resume",
                                         "--resume-override", "lr", "--resume-override", "steps", "--save-every", "1"))
    assert result.exit_code == 0, result.output
    assert "resumed from checkpoints/step_1 (step 1)" in caplog.text
    assert "save_every changed from 0 to 1" in caplog.text  # free to change, but said
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["policy/lr"] == pytest.approx(1e-3) and metrics[1]["policy/lr"] == pytest.approx(1e-2)
    assert yaml.safe_load((out / "config.until_step_1.yaml").read_text())["lr"] == 1e-3  # every config kept
    assert yaml.safe_load((out / "config.yaml").read_text())["lr"] == 1e-2


@pytest.mark.run
@pytest.mark.parametrize("command", ["train", "sft"])
def test_resume_of_a_finished_run_says_it_is_complete_and_changes_nothing(command, tiny_model_dir, task, tmp_path,
                                                                          plugins, caplog):
    out = tmp_path / "run"
    if command == "train":
        args = train_args(tiny_model_dir, task, out, "--steps", "1")
    else:
        (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n"
                                                    for a in range(4)))
        args = ["sft", "--model", str(tiny_model_dir), "--data", str(tmp_path / "sft.jsonl"), "--batch-size", "2",
                "--steps", "1", "--out", str(out), "--no-progress"]
    assert run_cli(plugins, args).exit_code == 0
    before = {p.relative_to(out): (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    again = run_cli(plugins, [*args, "--resume"])
    assert again.exit_code == 0, again.output
    assert f"{out} is complete (step 1 of 1, final/ written): --resume has nothing to do" in caplog.text
    after = {p.relative_to(out): (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    assert after == before  # nothing re-exported, no config.until_step_N.yaml


@pytest.mark.run
def test_resume_refuses_a_changed_component_setting_unless_overridden(tiny_model_dir, task, tmp_path, plugins):
    """Component settings are options too (config.yaml's ``components``): a resume that changes one
    is refused by its dotted name."""
    out = tmp_path / "run"
    assert run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "1")).exit_code == 0
    refused = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "2", "--clip-high", "0.3", "--resume",
                                          "--resume-override", "steps"))
    assert refused.exit_code == 2 and "policy_loss.clip_high: 0.2 -> 0.3" in refused.output, refused.output
    assert "--resume-override policy_loss.clip_high" in refused.output


@pytest.mark.run
def test_resume_override_of_an_unknown_option_is_a_usage_error(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    assert run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "1")).exit_code == 0
    result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "1", "--resume",
                                         "--resume-override", "learning_rate"))
    assert result.exit_code == 2 and "--resume-override learning_rate: no such option" in result.output


@pytest.mark.run
def test_a_run_that_failed_at_start_is_not_a_run(tiny_model_dir, task, tmp_path, make_plugin):
    def fail(run):
        raise RlhfError("a plugin broke at start")

    out = tmp_path / "run"
    broken = build_plugin_manager()
    broken.register(make_plugin("broken", on_run_start=fail))
    with pytest.raises(RlhfError, match="broke at start"):
        train(small_config(tiny_model_dir, task, out, steps=1), plugins=broken)
    assert (out / "config.yaml").is_file() and not RunDirectory(out).holds_run()
    train(small_config(tiny_model_dir, task, out, steps=1), plugins=build_plugin_manager())  # the corrected rerun
    assert RunDirectory(out).holds_run()
    with pytest.raises(RlhfError, match="already holds a run"):
        train(small_config(tiny_model_dir, task, out, steps=1), plugins=build_plugin_manager())


@pytest.mark.unit
def test_final_is_replaced_whole_or_not_at_all(tmp_path):
    run_dir = RunDirectory(tmp_path / "run")
    run_dir.path.mkdir()

    def write(folder: Path, text: str, fail: bool = False) -> None:
        (folder / "model.safetensors").write_text(text)
        if fail:
            raise OSError(28, "No space left on device", str(folder / "config.json"))
        (folder / "config.json").write_text("{}")

    run_dir.write_model(run_dir.final, lambda folder: write(folder, "first"))
    with pytest.raises(RlhfError, match=r"cannot write .*config.json: No space left on device"):
        run_dir.write_model(run_dir.final, lambda folder: write(folder, "second", fail=True))
    assert (run_dir.final / "model.safetensors").read_text() == "first"
    assert sorted(p.name for p in run_dir.final.iterdir()) == ["MANIFEST.json", "config.json", "model.safetensors"]


@pytest.mark.run
def test_a_full_disk_names_the_file_and_the_first_error_wins(tiny_model_dir, task, tmp_path, make_plugin):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")

    def fill(run):
        (Path(run.out_dir) / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC

    def end(run, status):
        raise RuntimeError("an on_run_end that fails too")

    plugins = build_plugin_manager()
    plugins.register(make_plugin("full", on_run_start=fill, on_run_end=end))
    with pytest.raises(RlhfError, match=r"cannot write .*metrics.jsonl: No space left on device"):
        train(small_config(tiny_model_dir, task, tmp_path / "run", steps=1), plugins=plugins)


@pytest.mark.unit
def test_on_run_end_errors_do_not_hide_a_completed_runs_failure_to_finish(tmp_path):
    """The other way round: a run that completed reports an on_run_end failure (nothing hides it)."""
    from rlhf.runtime.run.lifecycle import _end

    def emit(event, **kwargs):
        raise RuntimeError("flush failed")

    with pytest.raises(RuntimeError, match="flush failed"):
        _end(emit, None, "completed")
    _end(emit, None, "failed")  # logged: the run's own error is the one raised


# --- interrupts, end to end -------------------------------------------------------------------------


def _interrupt(args: list[str], sig: int, out: Path) -> subprocess.CompletedProcess:
    """Start ``python -m rlhf ARGS``, send ``sig`` once a step was logged, and wait for it to end."""
    env = {**os.environ, "RLHF_LOAD_PLUGINS": ""}
    process = subprocess.Popen([sys.executable, "-m", "rlhf", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no step was logged"
        time.sleep(0.05)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.run
def test_ctrl_c_finishes_the_step_writes_a_checkpoint_and_prints_the_resume_command(tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    result = _interrupt(train_args(tiny_model_dir, task, out, "--steps", "200"), signal.SIGINT, out)
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Aborted!" not in result.stderr and "Traceback" not in result.stderr
    resume = f"rlhf train --config {out / 'config.yaml'} --resume"
    assert f"Resume with: {resume}" in result.stderr
    logged = [m["step"] for m in read_jsonl(out / "metrics.jsonl")]
    assert 1 <= logged[-1] < 200 and (out / "checkpoints" / f"step_{logged[-1]}").is_dir()
    assert not (out / "final").exists()

    again = subprocess.run([sys.executable, "-m", *resume.split()[:-1], "--resume", "--steps", str(logged[-1] + 1),
                            "--resume-override", "steps"], capture_output=True, text=True,
                           env={**os.environ, "RLHF_LOAD_PLUGINS": ""})
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from checkpoints/step_{logged[-1]}" in again.stderr
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == list(range(1, logged[-1] + 2))


@pytest.mark.run
def test_sigterm_stops_an_sft_run_at_a_checkpoint(tiny_model_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}?", "response": f"A{i}"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    result = _interrupt(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--batch-size", "2",
                         "--micro-batch-size", "2", "--epochs", "100", "--out", str(out), "--no-progress"],
                        signal.SIGTERM, out)
    assert result.returncode == 130, result.stderr[-3000:]
    assert f"Resume with: rlhf fit --config {out / 'config.yaml'} --resume" in result.stderr
    last = read_jsonl(out / "metrics.jsonl")[-1]["step"]
    state = json.loads((out / "checkpoints" / f"step_{last}" / "trainer_state.json").read_text())
    assert state["step"] == last


@pytest.mark.run
def test_a_reward_that_fails_on_every_sample_warns_then_stops_the_run(tiny_model_dir, task, tmp_path, plugins,
                                                                      caplog):
    (tmp_path / "broken.py").write_text("def reward_func(completions, **kwargs):\n    raise ValueError('oops')\n")
    config = small_config(tiny_model_dir, task, tmp_path / "run", steps=5, reward=[str(tmp_path / "broken.py")],
                          reward_options={"on_error": "zero"}, max_failed_reward_steps=2)
    with pytest.raises(RlhfError, match="the reward reward_func failed on every sample for 2 steps in a row"):
        train(config, plugins=plugins)
    assert "step 1: the reward reward_func failed on every sample (--reward-on-error zero)" in caplog.text
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 1  # the stopping step is not logged (as for NaN)


@pytest.mark.unit
def test_torchs_iostream_error_on_a_full_disk_is_reported_as_such(tmp_path, monkeypatch):
    import shutil

    from rlhf.runtime.run import checkpoint

    def write(folder: Path) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 0))
    with pytest.raises(RlhfError, match=r"cannot write .*step_3: No space left on device \(0 MiB free there\)"):
        checkpoint.write_directory(tmp_path / "checkpoints" / "step_3", write)
    assert not (tmp_path / "checkpoints" / "step_3").exists()


@pytest.mark.unit
def test_the_same_signal_twice_abandons_the_step_the_launchers_sigterm_does_not():
    from rlhf.runtime.run.lifecycle import StopRequest

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # SIG_IGN under nohup or `cmd &`
    with StopRequest().installed() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: finish the step
        assert stop.requested == "SIGINT"
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun passing the Ctrl-C on: the same stop
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again: now
            time.sleep(1)  # the handler runs between bytecodes; this is where it raises
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # restored


@pytest.mark.unit
def test_logs_are_cut_back_to_the_checkpoint(tmp_path):
    from rlhf.runtime.run.run_dir import TRAINING, cut_logs, log_sizes
    from rlhf.runtime.run.run_files import RunFiles

    RunFiles.open(tmp_path, TRAINING).claim("metrics.jsonl", "samples.jsonl", log=True)  # the run's logs
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    state = {"step": 2, "log_sizes": log_sizes(tmp_path)}  # what a checkpoint of step 2 records
    with open(metrics, "a") as handle:
        handle.write('{"step": 3}\n{"step": 4, "torn')  # logged after it, and a line a kill cut short
    (tmp_path / "samples.jsonl").write_text('{"step": 3}\n')  # a file begun after it
    cut_logs(tmp_path, state)
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n' and (tmp_path / "samples.jsonl").read_text() == ""

    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "to')
    cut_logs(tmp_path, {"step": 2})  # a checkpoint from before log_sizes: by step
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'
    cut_logs(tmp_path, None)  # from step 0
    assert metrics.read_text() == ""


@pytest.mark.run
@pytest.mark.parametrize("mode", [[], ["--async", "--max-staleness", "1"]])
def test_runs_leave_no_threads_behind(tiny_model_dir, task, tmp_path, plugins, mode):
    """Three runs in one process (a notebook, a sweep): the threads after the first are the threads
    after the last (the async producer, reward loops and lock holders all end with their run)."""
    import threading

    def run(name):
        result = run_cli(plugins, train_args(tiny_model_dir, task, tmp_path / name, "--steps", "2", *mode))
        assert result.exit_code == 0, result.output

    run("first")
    before = sorted(t.name for t in threading.enumerate())
    run("second")
    run("third")
    assert sorted(t.name for t in threading.enumerate()) == before


@pytest.mark.run
def test_a_stop_during_the_last_step_still_completes_the_run(tiny_model_dir, task, tmp_path, make_plugin):
    """Ctrl-C while the last step runs: that step's checkpoint is the run's end, so final/ is written
    and the run completes (nothing is left to resume)."""
    def on_step_end(run, step, metrics):
        if step + 1 == 2:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only asks the loop to stop after this step

    plugins = build_plugin_manager()
    plugins.register(make_plugin("stopper", on_step_end=on_step_end))
    out = train(small_config(tiny_model_dir, task, tmp_path / "run", steps=2), plugins=plugins)
    assert (out / "final" / "model.safetensors").is_file()
    assert (out / "checkpoints" / "step_2").is_dir()


@pytest.mark.run
def test_start_up_objects_are_frozen_for_the_collector_during_the_steps_only(tiny_model_dir, task, tmp_path,
                                                                             make_plugin):
    """The cyclic garbage collector does not rescan the libraries and models every full pass: they are
    frozen before the first step (the model among them) and unfrozen when the run ends."""
    import gc

    seen = []

    def on_step_end(run, step, metrics):
        seen.append((gc.get_freeze_count(), any(type(o).__name__ == "LlamaForCausalLM" for o in gc.get_objects(2))))

    plugins = build_plugin_manager()
    plugins.register(make_plugin("watch", on_step_end=on_step_end))
    assert gc.get_freeze_count() == 0
    train(small_config(tiny_model_dir, task, tmp_path / "run", steps=2), plugins=plugins)
    assert len(seen) == 2 and all(count > 10_000 and not model_scanned for count, model_scanned in seen)
    assert gc.get_freeze_count() == 0
