"""The quickstart's checked-in assets: reward functions, toy data and the warmed tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.core.plugin_host.references import import_object

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "examples" / "tiny-model"
DATA_DIR = ROOT / "examples" / "data"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA_DIR / name).read_text().splitlines()]


@pytest.mark.unit
def test_exact_match_compares_stripped_completion_with_label():
    exact_match = import_object(f"{ROOT / 'examples' / 'rewards.py'}:exact_match")
    completions = ["68", " 68\n", "68, so 45+23=68", "6", "", "105"]
    labels = ["68", "68", "68", "68", "68", 105]
    assert exact_match(completions=completions, labels=labels, prompts=["x"] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.unit
def test_format_ok_accepts_digits_only():
    format_ok = import_object(f"{ROOT / 'examples' / 'rewards.py'}:format_ok")
    assert format_ok(completions=["68", " 7 ", "68, so 45+23=68", "", "6 8"]) == [1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.unit
def test_toy_data_is_addition_with_a_disjoint_held_out_split():
    train, held_out = _rows("train.jsonl"), _rows("eval.jsonl")
    assert (len(train), len(held_out)) == (2000, 500)
    for row in train + held_out:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["prompt"].endswith("=") and row["answer"] == str(int(a) + int(b)), row
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


@pytest.mark.unit
def test_tiny_model_loads_with_auto_classes_and_is_small():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    assert model.config.model_type == "llama" and len(tokenizer) == model.config.vocab_size == 261
    assert tokenizer.padding_side == "left"
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|pad|>", "<|eos|>")
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    # One token per character, so the answer's first token directly follows "=".
    assert tokenizer.tokenize("23+45=68") == list("23+45=68")
    assert sum(p.numel() for p in model.parameters()) == 591_744
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 3 * 2**20


@pytest.mark.run
def test_tiny_model_adds_but_often_rambles_on():
    """Greedy decoding gets the sum right but does not stop after it: the reward starts low."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    rows = _rows("eval.jsonl")[:50]
    enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=16)
    completions = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    sums_right = [c.split(",")[0].strip() == r["answer"] for c, r in zip(completions, rows)]
    exact = [c.strip() == r["answer"] for c, r in zip(completions, rows)]
    assert sum(sums_right) >= 40, completions
    assert sum(exact) <= 10, completions
