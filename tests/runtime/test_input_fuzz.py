"""Inputs that cannot hurt (docs/runs.md): hypothesis draws ``--config`` files and ``.jsonl`` rows
(wrong types, unknown keys, rows nested past any sane depth, lines that are no JSON) and runs
``rlhf train`` on them; whatever it draws, the command ends with exit 0, 1 or 2, a failure says so
in one line without a traceback, ``--out`` holds nothing half-written (no temporary file, no
lock, a ``final/`` only whole), and the process's peak memory stays within `PEAK_GROWTH_MB` of
where it was (a "billion laughs" config once took 0.9 GB)."""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers import run_cli

pytestmark = pytest.mark.run

# options a drawn config may set: safe to run for a step (the run's length and paths come from flags)
KEYS = ["lr", "seed", "kl_coef", "temperature", "top_p", "algo", "max_prompt_length", "reward_on_error", "save_every",
        "keep_checkpoints", "policy_loss.clip_high", "backend.weight_decay", "components", "apply_chat_template",
        "input_template", "entropy_coef", "input_key", "label_key", "advantage", "loss_agg"]
PATH_OPTIONS = {"out", "model", "tokenizer", "data", "eval_data", "reward", "critic_model", "env", "chat_template",
                "resume", "steps", "wandb_project", "tensorboard", "ray_address"}

scalars = (st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=6)
keys = st.sampled_from(KEYS) | st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=10).filter(
    lambda k: k not in PATH_OPTIONS)
plausible = st.fixed_dictionaries({}, optional={  # values of the right kind (or not quite), so that runs start too
    "lr": st.floats(1e-5, 1e-2) | values, "seed": st.integers(0, 100), "temperature": st.floats(0.1, 2.0),
    "kl_coef": st.floats(0, 0.5) | st.just("x"), "policy_loss.clip_high": st.floats(0.1, 0.5) | st.just([1, 2]),
    "max_prompt_length": st.integers(-1, 64), "reward_on_error": st.sampled_from(["raise", "skip", "zero", "bogus"]),
    "entropy_coef": st.floats(0, 0.1), "save_every": st.integers(0, 2), "top_p": st.floats(0.1, 1.0)})
configs = plausible | st.dictionaries(keys, values, max_size=3)
HOSTILE_YAML = [  # nested aliases (a "billion laughs"), a python tag, nesting thousands deep, no mapping, no YAML
    "a: &a [1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b]\n"
    "d: &d [*c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e]\n",
    "lr: !!python/object/apply:os.system ['true']\n", "lr: " + "[" * 5000 + "]" * 5000 + "\n", "- 1\n- 2\n",
    "lr: [unclosed\n", "\x00\x01", ""]
config_texts = configs.map(yaml.safe_dump) | st.sampled_from(HOSTILE_YAML)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


prompts = st.text(min_size=1, max_size=30) | st.integers() | st.none() | st.just([{"role": "user", "content": "hi"}])
rows = st.builds(lambda prompt, answer, extra, depth: json.dumps({"prompt": prompt, "answer": answer, "extra": extra})
                 [:-1] + (f', "deep": {nested(depth)}}}' if depth else "}"),
                 prompts, st.text(max_size=5) | st.integers() | st.none(), values,
                 st.sampled_from([0, 0, 0, 5, 999, 1001, 20_000]))
good_rows = st.builds(lambda a, b, extra: json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b),
                                                     "extra": extra}), st.integers(0, 9), st.integers(0, 9), values)
lines = good_rows | good_rows | rows | st.sampled_from(["", "not json", "[1, 2]", '{"prompt": "x"', '{"prompt": "What is 1 + 1?", '
                                                                           '"answer": "2"}'])
datasets = st.lists(lines, min_size=1, max_size=4)


PEAK_GROWTH_MB = 1500  # what the drawn runs together may add to this process's peak memory
_start_peak: list[int] = []


def peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def half_written(out: Path) -> list[str]:
    """What a command left in ``out`` that no finished write leaves."""
    if not out.exists():
        return []
    found = [str(p) for p in out.rglob("*") if p.name.endswith((".tmp", ".old", ".pruned")) or p.name == ".rlhf-lock"
             or p.name.startswith(".write-test")]
    final = out / "final"
    if final.exists() and not (final / "MANIFEST.json").is_file():
        found.append(str(final))
    return found


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(config=config_texts, data=datasets)
def test_drawn_configs_and_rows_end_in_one_line_or_a_run(tiny_model_dir, task, plugins, config, data):
    if not _start_peak:
        _start_peak.append(peak_mb())
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    (root / "c.yaml").write_text(config)
    (root / "d.jsonl").write_text("\n".join(data) + "\n")
    out = root / "run"
    result = run_cli(plugins, ["train", "--config", str(root / "c.yaml"), "--model", str(tiny_model_dir),
                               "--data", str(root / "d.jsonl"), "--label-key", "answer",
                               "--reward", str(task / "rewards.py"),
                               "--steps", "1", "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "2",
                               "--micro-batch-size", "2", "--out", str(out), "--no-progress", "--threads", "1"])
    event(f"exit {result.exit_code}")
    assert result.exit_code in (0, 1, 2), result.output
    assert "Traceback" not in result.output, result.output
    if result.exit_code != 0:
        errors = [line for line in result.output.splitlines() if line.startswith("Error")]
        assert len(errors) == 1, result.output
    else:
        assert (out / "final" / "MANIFEST.json").is_file()
    assert half_written(out) == [], result.output
    assert peak_mb() - _start_peak[0] < PEAK_GROWTH_MB, f"peak memory grew {peak_mb() - _start_peak[0]:.0f} MB"


def test_a_row_nested_20000_deep_is_one_line_and_leaves_no_lock(tiny_model_dir, task, plugins, tmp_path):
    """pyarrow's JSON reader died of SIGSEGV on it (exit 139, the lock left in --out), though the run
    does not use that column."""
    rows = (task / "data.jsonl").read_text().splitlines()
    rows[2] = rows[2][:-1] + ', "unused": ' + "[" * 20_000 + "]" * 20_000 + "}"
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(tmp_path / "d.jsonl"),
                               "--label-key", "answer", "--reward", str(task / "rewards.py"), "--steps", "1",
                               "--out", str(out), "--no-progress"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert errors == [f"Error: {tmp_path / 'd.jsonl'} line 3: a value nested more than 1,000 levels deep (of [ and {{); "
                      "such a row cannot be read safely: flatten it or drop it"], result.output
    assert not (out / ".rlhf-lock").exists() and half_written(out) == []
