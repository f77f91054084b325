"""One run per output: the lock a run holds for its life. A second command on the same --out (or
generate/score output file) stops with one line naming the holder and writes nothing; a lock left
by a killed run is taken over with a warning; the lock goes with the run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhf.runtime.run.run_lock import LOCK_NAME, RunInUseError, RunLock
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]


def tree(path):
    return {p.relative_to(path): p.stat().st_mtime_ns for p in path.rglob("*")} if path.exists() else {}


def train_args(model, task, out, *extra):
    return ["train", "--model", str(model), "--data", str(task / "data.jsonl"), "--label-key", "answer", "--reward",
            "exact_match", "--n-samples", "2", "--prompts-per-step", "2", "--max-new-tokens", "2", "--steps", "1",
            "--out", str(out), "--no-progress", *extra]


@pytest.mark.unit
def test_a_second_lock_on_the_same_directory_names_the_holder(tmp_path):
    first = RunLock.for_directory(tmp_path / "run").acquire()
    try:
        with pytest.raises(RunInUseError, match=rf"run is in use by another run \(pid {os.getpid()} on "
                                                rf"{socket.gethostname()}, started .*\): wait for it to end"):
            RunLock.for_directory(tmp_path / "run").acquire()
    finally:
        first.release()
    assert not (tmp_path / "run").exists()  # made for the lock, empty: removed with it
    with RunLock.for_directory(tmp_path / "run"):  # free again, no warning needed
        assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()


@pytest.mark.unit
@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_command_on_an_out_a_run_holds_stops_and_writes_nothing(command, tiny_model_dir, task, fit_data, tmp_path,
                                                                  plugins):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("the other run's")
    args = train_args(tiny_model_dir, task, out) if command == "train" else [
        "sft", "--model", str(tiny_model_dir), "--data", str(fit_data / "sft.jsonl"), "--out", str(out)]
    with RunLock.for_directory(out):
        before = tree(out)
        result = run_cli(plugins, args)
        assert result.exit_code == 1, result.output
        assert f"{out} is in use by another run (pid {os.getpid()}" in result.output and "Traceback" not in result.output
        assert tree(out) == before


@pytest.mark.run
def test_the_run_holds_the_lock_for_its_life_and_lets_it_go(tiny_model_dir, task, tmp_path, plugins, make_plugin):
    out = tmp_path / "run"
    held = []
    plugins.register(make_plugin("lock_probe", on_step_end=lambda run, step, metrics: held.append(
        json.loads((out / LOCK_NAME).read_text())["pid"])))
    assert run_cli(plugins, train_args(tiny_model_dir, task, out)).exit_code == 0
    assert held == [os.getpid()] and not (out / LOCK_NAME).exists()


@pytest.mark.run
def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tiny_model_dir, task, tmp_path, plugins, caplog):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK_NAME).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(),
                                             "started": "2026-01-01T00:00:00", "command": "rlhf train ..."}))
    result = run_cli(plugins, train_args(tiny_model_dir, task, out))
    assert result.exit_code == 0, result.output
    assert f"taking over the lock left by pid {int(dead.stdout)} on {socket.gethostname()}" in caplog.text
    (out / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "x", "command": "y"}))
    with RunLock.for_directory(out):
        pass
    assert "written on another host" in caplog.text


@pytest.mark.unit
@pytest.mark.parametrize("command", ["generate", "score"])
def test_generate_and_score_lock_their_output_file(command, task, tmp_path, plugins):
    target = tmp_path / "out.jsonl"
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "completions": ["2"]}) + "\n")
    args = [command, "--data", str(data), "--reward", "exact_match", "--label-key", "answer", "--out", str(target)]
    if command == "generate":
        args += ["--model", str(tmp_path / "not-loaded")]
    with RunLock.for_file(target):
        result = run_cli(plugins, args)
    assert result.exit_code == 1 and f"{target} is in use by another run" in result.output, result.output
    assert not target.exists()


HAMMER = textwrap.dedent("""
    import logging, os, sys, time
    from pathlib import Path
    from rlhf.runtime.run.run_lock import RunInUseError, RunLock

    logging.disable(logging.CRITICAL)
    target, marker, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    overlaps = held = 0
    while held < rounds:
        try:
            lock = RunLock.for_directory(target).acquire()
        except RunInUseError:
            continue
        try:  # while it holds the lock, nobody else may: the marker must not be there
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            overlaps += 1
        else:
            time.sleep(0.0005)
            os.close(fd)
            os.unlink(marker)
        held += 1
        lock.release()
    print(overlaps)
""")


@pytest.mark.unit
def test_runs_restarting_in_a_loop_never_hold_the_lock_together(tmp_path):
    """Release removes the file while holding it; a process that opened the old file just before
    must not count its lock of a file that is gone (two holders under a restart loop)."""
    target = tmp_path / "run"
    target.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    workers = [subprocess.Popen([sys.executable, "-c", HAMMER, str(target), str(tmp_path / "held"), "200"],
                                stdout=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    overlaps = [int(worker.communicate(timeout=300)[0]) for worker in workers]
    assert all(worker.returncode == 0 for worker in workers)
    assert overlaps == [0, 0, 0]
    assert sorted(p.name for p in target.iterdir()) == []  # the last release removed the file


@pytest.mark.unit
def test_a_lock_whose_holder_was_killed_is_stale_and_taken_over(tmp_path, caplog):
    target = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from rlhf.runtime.run.run_lock import RunLock
        RunLock.for_directory({str(target)!r}).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunInUseError, match=rf"pid {holder.pid} on"):
            RunLock.for_directory(target).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((target / LOCK_NAME).read_text())["pid"] == holder.pid  # left behind by the kill
    with RunLock.for_directory(target):
        assert json.loads((target / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"taking over the lock left by pid {holder.pid} on {socket.gethostname()}" in caplog.text
    assert not (target / LOCK_NAME).exists()
