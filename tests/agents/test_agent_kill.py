"""kill -9 during agent calls, then ``--resume``: the run ends with the samples, metrics and weights
of the uninterrupted run, bit for bit (synchronous and ``--async``). Every run is a process of its
own (one torch thread each), the killed one SIGKILLed by its agent between two requests of a call
made after a checkpoint (``--save-every 1``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import final_weights, read_jsonl

pytestmark = pytest.mark.run

pytest.importorskip("openai")

AGENTS = Path(__file__).with_name("agents.py")
KILL_ON_CALL = 13  # the first call of step 4 (4 calls a step): checkpoints after steps 1-3 exist by then


def _rlhf(model, task, out, calls, *extra, kill=0):
    env = {**os.environ, "RLHF_LOAD_PLUGINS": "", "OMP_NUM_THREADS": "1", "CALLS_FILE": str(calls),
           "KILL_ON_CALL": str(kill)}
    args = ["train", "--algo", "grpo", "--model", str(model), "--data", str(task / "data.jsonl"), "--input-key",
            "prompt", "--agent", f"{AGENTS}:dies_once", "--n-samples", "2", "--prompts-per-step", "2",
            "--max-new-tokens", "4", "--steps", "5", "--save-every", "1", "--lr", "1e-2", "--out", str(out),
            "--seed", "3", "--no-progress", *extra]
    return subprocess.run([sys.executable, "-m", "rlhf", *args], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("mode", [[], ["--async", "--max-staleness", "2"]], ids=["sync", "async"])
def test_kill_9_during_agent_calls_then_resume_equals_the_uninterrupted_run(tiny_model_dir, task, tmp_path, mode):
    whole = _rlhf(tiny_model_dir, task, tmp_path / "whole", tmp_path / "calls_whole", *mode)
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "killed"
    killed = _rlhf(tiny_model_dir, task, out, tmp_path / "calls", *mode, kill=KILL_ON_CALL)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert int((tmp_path / "calls").read_text()) >= KILL_ON_CALL
    assert any(p.name.startswith("step_") for p in (out / "checkpoints").iterdir())
    assert not (out / "final").exists()
    resumed = _rlhf(tiny_model_dir, task, out, tmp_path / "calls", *mode, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def comparable(rows):
        return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "async/wait", "async/idle"))
                 and "per_s" not in k} for row in rows]

    assert comparable(read_jsonl(out / "metrics.jsonl")) == comparable(read_jsonl(tmp_path / "whole" / "metrics.jsonl"))
    assert read_jsonl(out / "samples.jsonl") == read_jsonl(tmp_path / "whole" / "samples.jsonl")
    got, expected = final_weights(out), final_weights(tmp_path / "whole")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
