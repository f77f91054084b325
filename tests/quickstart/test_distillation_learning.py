"""On-policy distillation learns: `rlhf train --algo opd` distils the pipeline's SFT model (bare
answers) into the quickstart's tiny base model (which rambles after the answer) with no reward at
all. On held-out prompts the student's reverse KL to the teacher (exact, over the whole vocabulary,
along the student's own samples) drops by more than half, and its greedy exact-match accuracy
rises (the LoRA and --async runs: tests/runtime/test_teacher_runs.py).

Shape legend: ``B`` sequences, ``N`` new tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, read_jsonl

pytestmark = pytest.mark.run

BASE = ROOT / "examples" / "tiny-model"
HELD_OUT = [json.loads(line) for line in (ROOT / "examples" / "data" / "eval.jsonl").read_text().splitlines()][:64]


def held_out_figures(student_dir: Path, teacher_dir: Path, samples: int = 4, max_new: int = 12) -> tuple[float, float]:
    """(greedy exact-match accuracy, reverse KL per completion) of the student on HELD_OUT. The KL is
    KL(π_S ‖ π_T) = Σ_v π_S(v) (log π_S(v) − log π_T(v)) at every position of ``samples`` completions
    the student samples per prompt (temperature 1), up to its end-of-sequence token, summed over the
    completion and averaged over completions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(student_dir)  # left padding
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    prompts = tokenizer([row["prompt"] for row in HELD_OUT], return_tensors="pt", padding=True)
    width = prompts.input_ids.shape[1]
    with torch.no_grad():
        greedy = student.generate(**prompts, do_sample=False, max_new_tokens=max_new,
                                  pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(greedy[:, width:], skip_special_tokens=True)
        accuracy = sum(a.strip() == row["answer"] for a, row in zip(answers, HELD_OUT)) / len(HELD_OUT)
        torch.manual_seed(0)
        input_ids = prompts.input_ids.repeat_interleave(samples, 0)  # (B, P)
        attention = prompts.attention_mask.repeat_interleave(samples, 0)  # (B, P)
        out = student.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, max_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id)
        new = out[:, width:]  # (B, N)
        is_eos = (new == tokenizer.eos_token_id).long()  # (B, N)
        alive = (is_eos.cumsum(1) - is_eos) == 0  # (B, N) up to and with the first EOS
        mask = torch.cat([attention, alive.long()], dim=1)  # (B, P + N)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        log_s = torch.log_softmax(student(out, attention_mask=mask, position_ids=positions).logits[:, width - 1:-1]
                                  .float(), dim=-1)  # (B, N, V)
        log_t = torch.log_softmax(teacher(out, attention_mask=mask, position_ids=positions).logits[:, width - 1:-1]
                                  .float(), dim=-1)  # (B, N, V)
        kl = (log_s.exp() * (log_s - log_t)).sum(-1) * alive  # (B, N)
    return accuracy, float(kl.sum() / out.shape[0])


def test_opd_distils_the_sft_model_into_the_base(sft_teacher, tmp_path):
    out = tmp_path / "opd"
    command = [
        sys.executable, "-m", "rlhf", "train", "--algo", "opd", "--teacher", str(sft_teacher), "--model", str(BASE),
        "--data", str(ROOT / "examples" / "data" / "train.jsonl"), "--input-key", "prompt", "--n-samples", "4",
        "--prompts-per-step", "8", "--max-new-tokens", "12", "--steps", "40", "--lr", "1e-4", "--seed", "0",
        "--no-progress", "--out", str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "RLHF_LOAD_PLUGINS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(math.isfinite(m["teacher/reverse_kl"]) for m in metrics)
    assert all(m["reward/mean"] == 0.0 for m in metrics)  # no reward source: the teacher is the only signal

    accuracy_before, kl_before = held_out_figures(BASE, sft_teacher)
    accuracy_after, kl_after = held_out_figures(out / "final", sft_teacher)
    assert kl_before > 0.2, kl_before  # the base rambles where the teacher stops
    assert kl_after < kl_before / 2, (kl_before, kl_after)
    assert accuracy_after > accuracy_before + 0.5, (accuracy_before, accuracy_after)
