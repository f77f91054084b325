"""Library notices stay quiet without ``-v`` on every runtime (rlhf/runtime/notices.py): a
``--runtime ray`` run prints neither Ray's "Token authentication is enabled" warning (driver) nor
DeepSpeed's "Setting accelerator to CPU" line (forwarded from the actors by Ray), a ``--backend
deepspeed`` run not DeepSpeed's line; ``-v`` shows them again. In fresh processes with a user's
environment: the tests' DS_ACCELERATOR and RAY_AUTH_MODE removed (tests/conftest.py sets both, which
hides the notices), HOME a temporary folder (Ray writes its token to ~/.ray)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlhf.runtime import notices

pytestmark = pytest.mark.cluster

NOTICES = ("Setting accelerator to CPU", "Setting ds_accelerator", "Token authentication is enabled")


def run(work: Path, tiny_model_dir: Path, task: Path, *flags: str, verbose: bool) -> subprocess.CompletedProcess:
    out = work / f"run{len(os.listdir(work))}"
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "RAY_AUTH_MODE")}
    env.update(HOME=str(work / "home"), RAY_TMPDIR=str(work / "ray"), RLHF_LOAD_PLUGINS="")
    args = ["--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(task / "rewards.py"), "--prompts-per-step", "2", "--n-samples", "2",
            "--max-new-tokens", "4", "--micro-batch-size", "2", "--steps", "1", "--no-progress", "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "rlhf", *(["-v"] if verbose else []), "train", *args, *flags],
                          capture_output=True, text=True, env=env, cwd=work, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (out / "final" / "config.json").is_file()
    return done


@pytest.fixture
def work():
    path = Path(tempfile.mkdtemp(prefix="rlhf-q-"))  # short: Ray's socket paths live under RAY_TMPDIR
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_ray_run_prints_no_library_notices_without_verbose(tiny_model_dir, task, work):
    pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    flags = ("--runtime", "ray", "--policy-cpus", "0.5", "--ref-cpus", "0.5", "--rollout-cpus", "0.5")
    quiet = run(work, tiny_model_dir, task, *flags, verbose=False)
    printed = quiet.stdout + quiet.stderr
    assert not [line for line in printed.splitlines() if any(n in line for n in NOTICES)], printed
    assert quiet.stdout.strip().splitlines()[-1].startswith("run finished:"), printed

    loud = run(work, tiny_model_dir, task, *flags, verbose=True)
    assert "Token authentication is enabled for this Ray cluster" in loud.stderr, loud.stderr
    assert "(WorkerHost pid=" in loud.stdout and "Setting accelerator to CPU" in loud.stdout, loud.stdout


def test_a_deepspeed_run_prints_no_library_notices_without_verbose(tiny_model_dir, task, work):
    pytest.importorskip("deepspeed")
    flags = ("--backend", "deepspeed", "--zero-stage", "2")
    quiet = run(work, tiny_model_dir, task, *flags, verbose=False)
    printed = quiet.stdout + quiet.stderr
    assert not [line for line in printed.splitlines() if any(n in line for n in NOTICES)], printed
    loud = run(work, tiny_model_dir, task, *flags, verbose=True)
    assert "Setting accelerator to CPU" in loud.stdout + loud.stderr


def test_ray_workers_are_told_to_be_as_quiet_as_the_driver(monkeypatch):
    """The driver's `worker_environment` carries its quietness; a worker applies it before it imports DeepSpeed."""
    import logging

    logger = logging.getLogger(notices.LIBRARY_NOTICES[0][0])
    monkeypatch.setattr(logger, "filters", [])
    assert notices.worker_environment() == {}
    monkeypatch.setenv(notices.QUIET_ENV, "1")
    notices.quiet_if_asked()
    assert notices.notices_are_quiet() and notices.worker_environment() == {notices.QUIET_ENV: "1"}
    record = logging.LogRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 213,
                               "Setting accelerator to CPU. If you have GPU ...", None, None)
    assert not logger.filter(record)
