"""The shipped calculator agent (examples/agents/): its tool, the script that builds its tiny chat
model (the warm-up's text is what the chat template renders), and ``rlhf train --agent
examples/agents/calc.py:solve`` on the shipped model, a few steps end to end through the CLI (the
README's command, shortened)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.core.plugin_host.references import import_object
from tests.helpers import read_jsonl, run_cli

pytestmark = pytest.mark.run

pytest.importorskip("openai")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents"


def test_the_calculator_tool():
    calculate = import_object(f"{EXAMPLE / 'calc.py'}:calculate")
    assert [calculate(e) for e in ("23*47", " 2 + 3*4 ", "7//2", "1/0", "2*(3", "__import__('os')", "2**99")] == [
        "1081", "14", "3", "error", "error", "error", "error"]


def test_the_script_builds_a_chat_model_that_calls_the_tool_in_its_template(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLE / "make_calc_model.py"), "--steps", "2", "--late-steps", "1",
                             "--model-dir", str(tmp_path / "model"), "--data-dir", str(tmp_path / "data")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "calls the tool" in result.stdout
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert tokenizer.eos_token == "<|im_end|>"
    digits = tokenizer("1081", add_special_tokens=False)["input_ids"]
    assert len(digits) == 4  # a token per digit
    rows = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 2000 and all(int(r["answer"]) == eval(r["prompt"]) for r in rows)  # noqa: S307 - "a*b"
    held_out = {json.loads(line)["prompt"] for line in (tmp_path / "data" / "eval.jsonl").read_text().splitlines()}
    assert held_out.isdisjoint(r["prompt"] for r in rows)


def test_rlhf_train_with_the_calc_agent_end_to_end(plugins, tmp_path):
    out = tmp_path / "run"
    result = run_cli(plugins, [
        "train", "--algo", "grpo", "--model", str(EXAMPLE / "calc-model"), "--data",
        str(EXAMPLE / "data" / "train.jsonl"), "--input-key", "prompt", "--agent", f"{EXAMPLE / 'calc.py'}:solve",
        "--n-samples", "4", "--prompts-per-step", "4", "--max-new-tokens", "16", "--lr", "1e-3", "--steps", "2",
        "--seed", "0", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(out / "metrics.jsonl")
    assert len(metrics) == 2
    for row in metrics:
        # every call ends with a reward (a completion the parser cannot read comes back as text, counted)
        assert row["agent/failure_rate"] == 0.0 and 0.0 <= row["agent/parse_failure_rate"] < 0.5
        assert 1.0 <= row["agent/requests_mean"] <= 3.0 and 0.0 <= row["reward/mean"] <= 1.0
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 32 and all(s["reward"] in (0.0, 1.0) for s in samples)
    called = [s for s in samples if any(o == "tool" for o, _ in s["token_origins"])]
    assert called, "some trajectory called the tool"
    for sample in called:  # the tool's result came back as a tool message and the model answered after it
        origins = [o for o, _ in sample["token_origins"]]
        assert origins.index("tool") < len(origins) - 1 - origins[::-1].index("model")
