"""Prompts are cut before they are tokenised (rlhf/core/inputs/text_bounds.py): a prompt of megabytes
costs the tokenizer no more than the budget could keep, and gives the same tokens a whole
tokenisation cut to the budget gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.core.inputs.text_bounds import MARGIN_TOKENS, char_bound, longest_token_chars
from rlhf.runtime.run.data import DataSettings, PromptFormatter, load_prompts


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Spy:
    """The tokenizer, recording the length of every text it is called on."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.unit
def test_the_bound_follows_the_longest_token(tokenizer):
    longest = max(len(token) for token in tokenizer.get_vocab())
    assert longest_token_chars(tokenizer) == longest
    assert char_bound(tokenizer, 100) == (100 + MARGIN_TOKENS) * longest


@pytest.mark.unit
@pytest.mark.parametrize("chat", [False, True])
def test_a_long_prompt_is_cut_before_the_tokenizer_and_keeps_its_last_tokens(tmp_path, tokenizer, chat):
    prompt = "".join(f"word{i} " for i in range(200_000)) + "What is 2 + 2?"  # ~2 MB
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": prompt}) + "\n")
    settings = DataSettings(paths=[str(path)], max_prompt_length=50, apply_chat_template=chat)
    spy = Spy(tokenizer)
    item = PromptFormatter(spy, settings)(load_prompts(settings)[0])
    assert spy.lengths and max(spy.lengths) <= char_bound(tokenizer, 50) + 200  # + the chat template's own text
    assert item.truncated and len(item.prompt_ids) == 50
    if chat:
        whole = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                              add_generation_prompt=True)
        expected = tokenizer(whole, add_special_tokens=False)["input_ids"][-50:]
    else:
        expected = tokenizer(prompt)["input_ids"][-50:]
    assert item.prompt_ids == expected  # what tokenising it whole and cutting gave
    assert len(item.prompt) <= char_bound(tokenizer, 50)  # the item carries no megabytes on


@pytest.mark.unit
def test_the_fit_formatter_skips_an_overlong_prompt_untokenised_and_cuts_a_response_first(tokenizer):
    from rlhf.core.protocols.objective import SkipExample
    from rlhf.runtime.fit.text import TextFormatter

    spy = Spy(tokenizer)
    text = TextFormatter(spy, max_len=64)
    with pytest.raises(SkipExample, match="no room for a response"):
        text.prompt_ids("x " * 1_000_000)
    assert spy.lengths == []
    response = "".join(f"w{i} " for i in range(300_000))
    ids = text.ids(response)
    assert max(spy.lengths) <= char_bound(tokenizer, 64)
    assert ids[:64] == tokenizer(response, add_special_tokens=False)["input_ids"][:64]


@pytest.mark.run
def test_a_20_mb_prompt_through_rlhf_train_stays_small(tiny_model_dir, task, tmp_path):
    """Tokenised whole, this prompt took the process to 3.7 GB (and 20 s of CPU); cut first, the run
    peaks where a run of short prompts does."""
    rows = [json.loads(line) for line in (task / "data.jsonl").read_text().splitlines()]
    rows[0]["prompt"] = "word " * 4_000_000 + rows[0]["prompt"]
    data = tmp_path / "big.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert data.stat().st_size > 20_000_000
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--label-key", "answer", "--reward",
            str(task / "rewards.py"), "--prompts-per-step", str(len(rows)), "--n-samples", "2", "--max-new-tokens",
            "3", "--micro-batch-size", "4", "--lr", "1e-3", "--steps", "1", "--out", str(out), "--no-progress"]
    measure = ("import resource, subprocess, sys; code = subprocess.call([sys.executable, '-m', 'rlhf', "
               "*sys.argv[1:]]); print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", measure, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    peak_mb = int(result.stdout.split("PEAK")[-1]) / 1024
    assert peak_mb < 1500, f"peak {peak_mb:.0f} MB"
    assert "prompt longer than --max-prompt-length" in result.stderr and (out / "final").is_dir()
    assert Path(out / "samples.jsonl").stat().st_size < 1_000_000
