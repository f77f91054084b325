"""On-policy distillation learns, as examples/distill/run.sh shows it: `rlhf train --algo opd` distils
the pipeline's SFT model (bare answers) into the quickstart's tiny base model (which rambles after the
answer) with no reward at all. On held-out prompts the student's reverse KL to the teacher (exact, over
the whole vocabulary, along the student's own samples: examples/distill/report.py) drops by more than
half, and its greedy exact-match accuracy rises (the LoRA and --async runs:
tests/runtime/test_teacher_runs.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, read_jsonl

pytestmark = pytest.mark.run


def test_opd_distils_the_sft_model_into_the_base(sft_teacher, tmp_path):
    """``bash examples/distill/run.sh OUT TEACHER`` with the session's SFT teacher (the script's own
    SFT step, shared with other tests): 40 steps of `--algo opd`, then its report."""
    out = tmp_path / "distill"
    done = subprocess.run(["bash", str(ROOT / "examples" / "distill" / "run.sh"), str(out), str(sft_teacher)],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "RLHF_LOAD_PLUGINS": "", "PATH": f"{Path(sys.executable).parent}:"
                                                                               f"{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = read_jsonl(out / "opd" / "metrics.jsonl")
    assert len(metrics) == 40
    assert all(math.isfinite(m["teacher/reverse_kl"]) for m in metrics)
    assert all(m["reward/mean"] == 0.0 for m in metrics)  # no reward source: the teacher is the only signal

    figures = json.loads((out / "report.json").read_text())
    kl_before, kl_after = figures["kl_before"], figures["kl_after"]
    accuracy_before, accuracy_after = figures["exact_match_before"], figures["exact_match_after"]
    assert kl_before > 0.2, kl_before  # the base rambles where the teacher stops
    assert kl_after < kl_before / 2, (kl_before, kl_after)
    assert accuracy_after > accuracy_before + 0.5, (accuracy_before, accuracy_after)
    line = done.stdout.strip().splitlines()[-1]
    assert [float(x) for x in re.findall(r"\d+\.\d+", line)] == pytest.approx(
        [kl_before, kl_after, accuracy_before, accuracy_after], abs=0.006), line
