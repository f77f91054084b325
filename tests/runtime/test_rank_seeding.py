"""Under torchrun every rank used to seed its sampling alike, so ranks given the same prompt drew
the same completions (issue 19). Rank r > 0 now samples with ``seed + r`` (as the Ray runtime
does): different ranks differ, and the same command gives the same samples again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.runtime.rl.local import sampling_seed

from tests.helpers import torchrun


@pytest.mark.unit
def test_every_rank_has_its_own_sampling_seed():
    seeds = [sampling_seed(42, rank) for rank in range(4)]
    assert seeds[0] == 42 and len(set(seeds)) == 4


def _samples(tiny_model_dir: Path, tmp_path: Path, name: str) -> list[dict]:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Count: one two", "answer": "x"}) + "\n" for _ in range(8)))
    reward = tmp_path / "rewards.py"
    reward.write_text("def reward_func(completions, **kw):\n    return [0.0 for c in completions]\n")
    out = tmp_path / name
    torchrun(2, "-m", "rlhf", "train", "--model", str(tiny_model_dir), "--data", str(data), "--label-key", "answer",
             "--reward", str(reward), "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "12",
             "--micro-batch-size", "2", "--temperature", "1.0", "--no-progress", "--steps", "1", "--out", str(out))
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


@pytest.mark.cluster
def test_two_ranks_sample_differently_and_reproducibly(tiny_model_dir, tmp_path):
    first = _samples(tiny_model_dir, tmp_path, "a")
    assert len(first) == 4  # 2 ranks x 1 prompt x 2 samples, gathered in rank order
    key = next(k for k in ("completion", "completion_text", "response") if k in first[0])
    rank0, rank1 = [s[key] for s in first[:2]], [s[key] for s in first[2:]]
    assert rank0 != rank1, "both ranks drew the same completions for the same prompt"
    again = _samples(tiny_model_dir, tmp_path, "b")
    assert [s[key] for s in again] == [s[key] for s in first]
