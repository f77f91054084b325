"""``rlhf iterate`` on the tiny model: two rounds of generate -> pairs -> dpo in one run directory,
the second round sampling from (and training on top of) the first round's model; a rerun
continues after the last complete round."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_cli

pytestmark = pytest.mark.run

REWARD = "def score(completions, **kwargs):\n    return [float(len(set(c))) for c in completions]\n"


def ok(plugins, args):
    result = run_cli(plugins, args + ["--no-progress"])
    assert result.exit_code == 0, result.output
    return result


def test_two_rounds_the_second_starting_from_the_first_rounds_model(plugins, tiny_model_dir, task, tmp_path):
    from transformers import AutoModelForCausalLM

    (tmp_path / "rewards.py").write_text(REWARD)
    reward = f"{tmp_path / 'rewards.py'}:score"
    sampling = ["--n", "4", "--max-new-tokens", "6", "--batch-size", "4", "--seed", "5"]
    out = tmp_path / "idpo"
    args = ["iterate", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--reward", reward,
            *sampling, "--rounds", "2", "--lr", "1e-3", "--dpo-batch-size", "4", "--micro-batch-size", "4",
            "--beta", "0.5", "--out", str(out)]
    ok(plugins, args)

    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    first, second = out / "round_1", out / "round_2"
    assert rounds[0]["start_model"] == str(tiny_model_dir)
    assert rounds[1]["start_model"] == rounds[0]["model"] == str((first / "dpo" / "final").resolve())
    assert (first / "model").resolve() == (first / "dpo" / "final").resolve()
    assert {p.name for p in first.iterdir()} >= {"generations.jsonl", "pairs.jsonl", "dpo", "model", "round.json"}
    for r in rounds:
        assert r["pairs"] > 0 and r["reward/chosen_mean"] > r["reward/rejected_mean"]
        assert "dpo/train/loss" in r
    # the DPO run of round 2 starts from round 1's model (its reference too: the objective has none other)
    import yaml

    assert yaml.safe_load((second / "dpo" / "config.yaml").read_text())["model"] == rounds[0]["model"]
    assert yaml.safe_load((first / "dpo" / "config.yaml").read_text())["components"]["objective"]["beta"] == 0.5
    # round 1 changed the weights, and round 2 sampled from them: the same generation from round 1's
    # model with round 2's seed reproduces round 2's samples exactly
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(first / "dpo" / "final").state_dict()
    assert any(not torch.equal(base[name], trained[name]) for name in base)
    ok(plugins, ["generate", "--model", rounds[0]["model"], "--data", str(task / "data.jsonl"), "--reward", reward,
                 *sampling[:-1], "6", "--out", str(tmp_path / "again.jsonl")])
    assert (tmp_path / "again.jsonl").read_bytes() == (second / "generations.jsonl").read_bytes()
    pairs = [json.loads(line) for line in (second / "pairs.jsonl").read_text().splitlines()]
    assert all(set(p) == {"prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"} for p in pairs)

    # resumable at round granularity: an unfinished round 2 is redone, round 1 is kept
    import shutil

    round_1_files = {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()}
    generations = (second / "generations.jsonl").read_bytes()
    (second / "round.json").unlink()
    shutil.rmtree(second / "dpo" / "final")
    (second / "generations.jsonl").write_bytes(generations.splitlines(keepends=True)[0][:-5])  # killed mid-row
    beside = {out / "notes.jsonl": '{"mine": 1}\n', second / "mine.txt": "mine", second / "dpo" / "mine.jsonl": "x\n"}
    for path, text in beside.items():  # files a user put beside the runs: neither iterate nor DPO's resume owns them
        path.write_text(text)
    ok(plugins, args)
    assert {path: path.read_text() for path in beside} == beside
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()} == round_1_files
    assert (second / "generations.jsonl").read_bytes() == generations
    assert (second / "model" / "config.json").exists()
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_advice_from_the_dpo_round_names_iterates_own_flag(plugins, tiny_model_dir, task, tmp_path):
    (tmp_path / "rewards.py").write_text(REWARD)
    result = run_cli(plugins, ["iterate", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--reward", f"{tmp_path / 'rewards.py'}:score", "--n", "2", "--max-new-tokens", "4",
                               "--rounds", "1", "--dpo-batch-size", "1000", "--out", str(tmp_path / "idpo"),
                               "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "fewer than --dpo-batch-size 1000; lower --dpo-batch-size" in result.output
    assert "--batch-size 1000" not in result.output.replace("--dpo-batch-size", "")
