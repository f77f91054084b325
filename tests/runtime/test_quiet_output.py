"""What a normal run prints: its own lines, not the libraries' notices (DeepSpeed's "Setting
accelerator to CPU" once the cpu extra is installed, transformers' deprecation warnings about the
arguments we pass); ``--verbose`` shows the notices again. In fresh processes, since DeepSpeed
prints its notice once per process, when transformers first imports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.run

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *before: str) -> str:
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n" for a in range(4)))
    out = tmp_path / f"run{len(before)}"
    done = subprocess.run([sys.executable, "-m", "rlhf", *before, "sft", "--model", str(ROOT / "examples" / "tiny-model"),
                           "--data", str(data), "--steps", "1", "--batch-size", "2", "--out", str(out),
                           "--no-progress"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"})  # as a user's shell
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_a_normal_run_prints_no_library_notices_and_verbose_shows_them(tmp_path):
    pytest.importorskip("deepspeed")
    quiet = run(tmp_path)
    assert "Setting accelerator" not in quiet and "FutureWarning" not in quiet, quiet
    assert quiet.strip().splitlines()[-1].startswith("run finished:")
    assert "Setting accelerator to CPU" in run(tmp_path, "--verbose")


def test_a_generation_step_passes_no_deprecated_argument(tiny_model_dir, tmp_path, plugins):
    import warnings

    from tests.helpers import run_cli

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        result = run_cli(plugins, ["generate", "--model", str(tiny_model_dir), "--data", str(tmp_path / "p.jsonl"),
                                   "--n-samples", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "g.jsonl"),
                                   "--no-progress"])
    assert result.exit_code == 0, result.output
