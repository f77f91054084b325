"""``rlhf generate`` and ``rlhf score`` end to end on the tiny model: the row format of each mode,
selections checked against the rewards in the file, determinism, resume after a kill (every
prompt exactly once, the same rows as an uninterrupted run), and torchrun data parallelism."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cli

# A reward with many distinct values (and some ties): the number of distinct characters.
REWARD = "def score(completions, **kwargs):\n    return [float(len(set(c))) for c in completions]\n"
# Kills its own process (SIGKILL: no cleanup) on the call named by $KILL_ON_CALL.
KILLING_REWARD = REWARD + '''
import os, signal
from pathlib import Path

def score_then_die(completions, **kwargs):
    counter = Path(os.environ["CALLS_FILE"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    if calls == int(os.environ["KILL_ON_CALL"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return score(completions)
'''
PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "topic": "sums"} for a in range(3) for b in range(3)]


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    (tmp_path / "rewards.py").write_text(KILLING_REWARD)

    def args(out: str, *extra: str, reward: bool = True) -> list[str]:
        return (["generate", "--model", str(tiny_model_dir), "--data", str(tmp_path / "prompts.jsonl"),
                 "--label-key", "answer", "--n-samples", "4", "--max-new-tokens", "6", "--batch-size", "2",
                 "--out", str(tmp_path / out), "--no-progress", "--seed", "7"]
                + (["--reward", f"{tmp_path / 'rewards.py'}:score"] if reward else []) + list(extra))
    return args


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def ok(plugins, args: list[str]):
    result = run_cli(plugins, args)
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.run
def test_each_mode_writes_its_rows_and_selects_by_the_rewards_in_the_file(plugins, job, tmp_path):
    ok(plugins, job("all.jsonl"))
    samples = read(tmp_path / "all.jsonl")
    assert [row["prompt"] for row in samples] == [p["prompt"] for p in PROMPTS]  # one row per prompt, in order
    for row, prompt in zip(samples, PROMPTS):
        assert set(row) == {"prompt", "completions", "rewards", "label", "answer", "topic"}
        assert row["label"] == row["answer"] == prompt["answer"] and row["topic"] == "sums"
        assert len(row["completions"]) == len(row["rewards"]) == 4
        assert row["rewards"] == [float(len(set(c))) for c in row["completions"]]

    ok(plugins, job("best.jsonl", "--best-of-n"))
    for row, full in zip(read(tmp_path / "best.jsonl"), samples, strict=True):
        assert set(row) == {"prompt", "response", "reward"}
        assert row["prompt"] == full["prompt"]
        assert row["reward"] == max(full["rewards"])
        assert row["response"] == full["completions"][full["rewards"].index(max(full["rewards"]))]

    result = ok(plugins, job("pairs.jsonl", "--pairs"))
    pairs = {row["prompt"]: row for row in read(tmp_path / "pairs.jsonl")}
    ties = 0
    for full in samples:
        if max(full["rewards"]) == min(full["rewards"]):
            ties += 1
            assert full["prompt"] not in pairs
            continue
        row = pairs[full["prompt"]]
        assert set(row) == {"prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"}
        assert (row["chosen_reward"], row["rejected_reward"]) == (max(full["rewards"]), min(full["rewards"]))
        assert row["chosen"] == full["completions"][full["rewards"].index(max(full["rewards"]))]
        assert row["rejected"] == full["completions"][full["rewards"].index(min(full["rewards"]))]
    assert len(pairs) == len(PROMPTS) - ties
    if ties:
        assert f"{ties} skipped (all their samples tie)" in result.output

    ok(plugins, job("csft.jsonl", "--conditional"))
    for row, full in zip(read(tmp_path / "csft.jsonl"), samples, strict=True):
        assert set(row) == {"prompt", "response", "reward"}
        assert row["prompt"] == f"{full['prompt']} <rm_score>: {row['reward']:.2f} "  # OpenRLHF's template
        assert row["response"] in full["completions"]
        assert row["reward"] == full["rewards"][full["completions"].index(row["response"])]

    ok(plugins, job("csft_all.jsonl", "--conditional", "--conditional-rows", "sample",
                    "--reward-template", "[score {reward}] {input}"))
    rows = read(tmp_path / "csft_all.jsonl")
    assert len(rows) == 4 * len(PROMPTS)
    assert rows[1] == {"prompt": f"[score {samples[0]['rewards'][1]:.2f}] {samples[0]['prompt']}",
                       "response": samples[0]["completions"][1], "reward": samples[0]["rewards"][1]}


@pytest.mark.run
def test_without_a_reward_rows_have_no_rewards_and_the_same_samples(plugins, job, tmp_path):
    ok(plugins, job("a.jsonl"))
    ok(plugins, job("b.jsonl", reward=False))
    a, b = read(tmp_path / "a.jsonl"), read(tmp_path / "b.jsonl")
    assert all("rewards" not in row for row in b)
    assert [row["completions"] for row in a] == [row["completions"] for row in b]  # rewards do not touch sampling


@pytest.mark.run
def test_the_same_seed_gives_the_same_file_and_another_seed_another(plugins, job, tmp_path):
    ok(plugins, job("one.jsonl", reward=False))
    ok(plugins, job("two.jsonl", reward=False))
    ok(plugins, job("three.jsonl", "--seed", "8", reward=False))
    assert (tmp_path / "one.jsonl").read_bytes() == (tmp_path / "two.jsonl").read_bytes()
    assert (tmp_path / "one.jsonl").read_bytes() != (tmp_path / "three.jsonl").read_bytes()


@pytest.mark.unit
def test_selections_need_a_reward_and_exclude_each_other(plugins, job):
    result = run_cli(plugins, job("x.jsonl", "--pairs", reward=False))
    assert result.exit_code == 2 and "--pairs ranks samples by reward: add --reward" in result.output
    result = run_cli(plugins, job("x.jsonl", "--pairs", "--best-of-n"))
    assert result.exit_code == 2 and "pick one" in result.output


@pytest.mark.run
def test_a_killed_run_continues_and_writes_every_prompt_exactly_once(plugins, job, tmp_path):
    """SIGKILL inside the reward of the third batch (prompts 5-6 of 9); the rerun writes the same
    file as an uninterrupted run. A torn row after the last record is dropped too."""
    env = {**os.environ, "RLHF_LOAD_PLUGINS": "", "CALLS_FILE": str(tmp_path / "calls"), "KILL_ON_CALL": "3",
           "OMP_NUM_THREADS": "1"}
    args = [a.replace(":score", ":score_then_die") for a in job("killed.jsonl")]
    killed = subprocess.run([sys.executable, "-m", "rlhf", *args], env=env, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    out = tmp_path / "killed.jsonl"
    assert [row["prompt"] for row in read(out)] == [p["prompt"] for p in PROMPTS[:4]]
    with open(out, "a") as handle:  # as if killed in the middle of writing a row
        handle.write('{"prompt": "0+0=", "completi')
    env["KILL_ON_CALL"] = "0"
    resumed = subprocess.run([sys.executable, "-m", "rlhf", *args], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert int((tmp_path / "calls").read_text()) == 3 + 3  # batches 3, 4, 5 of 5 (nothing redone)
    ok(plugins, job("whole.jsonl"))  # the uninterrupted run: no process of its own needed
    assert [row["prompt"] for row in read(out)] == [p["prompt"] for p in PROMPTS]
    assert out.read_bytes() == (tmp_path / "whole.jsonl").read_bytes()


@pytest.mark.run
def test_a_file_cut_anywhere_is_completed_to_the_same_bytes(plugins, job, tmp_path):
    ok(plugins, job("whole.jsonl", "--pairs"))
    whole = (tmp_path / "whole.jsonl").read_bytes()
    lines = whole.splitlines(keepends=True)
    for keep in (0, 1, 3, len(lines) - 1):
        ok(plugins, job("cut.jsonl", "--pairs", "--overwrite" if keep == 0 else "--no-overwrite"))
        cut = b"".join(lines[:keep]) + lines[keep][:7]  # whole rows, then a torn one
        (tmp_path / "cut.jsonl").write_bytes(cut)
        ok(plugins, job("cut.jsonl", "--pairs"))
        assert (tmp_path / "cut.jsonl").read_bytes() == whole, keep


@pytest.mark.run
def test_a_rerun_of_a_finished_file_changes_nothing_and_other_settings_are_refused(plugins, job, tmp_path):
    ok(plugins, job("done.jsonl", reward=False))
    before = (tmp_path / "done.jsonl").read_bytes()
    assert "already complete" in ok(plugins, job("done.jsonl", reward=False)).output
    assert (tmp_path / "done.jsonl").read_bytes() == before
    result = run_cli(plugins, job("done.jsonl", "--n", "2", reward=False))
    assert result.exit_code == 2 and "was started with other settings (n=4)" in result.output
    ok(plugins, job("done.jsonl", "--n", "2", "--overwrite", reward=False))
    assert all(len(row["completions"]) == 2 for row in read(tmp_path / "done.jsonl"))
    (tmp_path / "mine.jsonl").write_text('{"keep": 1}\n')
    result = run_cli(plugins, job("mine.jsonl", reward=False))
    assert result.exit_code == 2 and "was not written by this command" in result.output


@pytest.mark.run
def test_rlhf_score_scores_existing_completions_like_generate_does(plugins, job, tmp_path):
    ok(plugins, job("plain.jsonl", reward=False))
    ok(plugins, job("scored_by_generate.jsonl"))
    reward = f"{tmp_path / 'rewards.py'}:score"
    ok(plugins, ["score", "--data", str(tmp_path / "plain.jsonl"), "--reward", reward, "--out",
                 str(tmp_path / "scored.jsonl"), "--no-progress"])
    scored, expected = read(tmp_path / "scored.jsonl"), read(tmp_path / "scored_by_generate.jsonl")
    assert [row["rewards"] for row in scored] == [row["rewards"] for row in expected]
    assert all(set(row) == {"prompt", "completions", "rewards", "label", "answer", "topic"} for row in scored)
    ok(plugins, ["score", "--data", str(tmp_path / "plain.jsonl"), "--reward", reward, "--pairs", "--out",
                 str(tmp_path / "pairs.jsonl"), "--no-progress"])
    ok(plugins, job("pairs_by_generate.jsonl", "--pairs"))
    assert read(tmp_path / "pairs.jsonl") == read(tmp_path / "pairs_by_generate.jsonl")
    # one completion per row: scored into "reward"; weights and several sources combine
    ok(plugins, ["score", "--data", str(tmp_path / "pairs.jsonl"), "--completions-key", "chosen", "--reward",
                 f"{reward}@0.5", "--reward", f"{reward}@2", "--out", str(tmp_path / "one.jsonl"), "--no-progress"])
    for row in read(tmp_path / "one.jsonl"):
        assert row["reward"] == pytest.approx(2.5 * row["chosen_reward"])


@pytest.mark.cluster
def test_two_torchrun_ranks_write_the_file_one_process_writes(plugins, job, tmp_path):
    ok(plugins, job("one.jsonl", "--pairs"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHF_LOAD_PLUGINS": ""}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "rlhf", *job("two.jsonl", "--pairs")], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "one.jsonl").read_bytes() == (tmp_path / "two.jsonl").read_bytes()
    assert not list(tmp_path.glob("two.jsonl.rank*"))


CHAT_PROMPTS = [{"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+{b}"}],
                 "answer": str(a + b)} for a in range(2) for b in range(3)]
# Abstains (None) on completions with a comma: written as null and never selected. With chat
# prompts, completions reach reward functions as assistant messages (TRL's convention).
PICKY_REWARD = '''
def score(completions, answer, **kwargs):
    texts = [c[0]["content"] for c in completions]
    return [None if "," in c else float(len(set(c))) + (c.strip() == a) for c, a in zip(texts, answer)]
'''


@pytest.mark.run
def test_chat_prompts_and_the_files_feed_rlhf_sft_and_rlhf_dpo_without_conversion(plugins, tiny_model_dir, tmp_path):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CHAT_PROMPTS))
    (tmp_path / "picky.py").write_text(PICKY_REWARD)
    common = ["generate", "--model", str(tiny_model_dir), "--data", str(tmp_path / "chat.jsonl"), "--input-key",
              "messages", "--apply-chat-template", "--n", "4", "--max-new-tokens", "6", "--reward",
              f"{tmp_path / 'picky.py'}:score", "--no-progress"]
    ok(plugins, common + ["--out", str(tmp_path / "all.jsonl")])
    samples = read(tmp_path / "all.jsonl")
    assert [row["prompt"] for row in samples] == [row["messages"] for row in CHAT_PROMPTS]
    assert all(set(row) == {"prompt", "completions", "rewards", "answer"} for row in samples)
    for row in samples:
        for completion, reward in zip(row["completions"], row["rewards"]):
            assert (reward is None) == ("," in completion)
    ok(plugins, common + ["--best-of-n", "--out", str(tmp_path / "rs.jsonl")])
    for row, full in zip(read(tmp_path / "rs.jsonl"), [s for s in samples if any(r is not None for r in s["rewards"])],
                         strict=True):
        assert row["reward"] == max(r for r in full["rewards"] if r is not None)
    ok(plugins, common + ["--conditional", "--out", str(tmp_path / "csft.jsonl")])
    for row in read(tmp_path / "csft.jsonl"):
        assert row["prompt"][0] == {"role": "system", "content": "Add."}
        assert row["prompt"][1]["content"].endswith(f" <rm_score>: {row['reward']:.2f} ")
    ok(plugins, common + ["--pairs", "--out", str(tmp_path / "pairs.jsonl")])
    assert read(tmp_path / "pairs.jsonl")

    fit = ["--model", str(tiny_model_dir), "--apply-chat-template", "--steps", "1", "--batch-size", "2",
           "--micro-batch-size", "2", "--no-progress"]
    ok(plugins, ["sft", "--data", str(tmp_path / "rs.jsonl"), "--output-key", "response", "--out",
                 str(tmp_path / "sft"), *fit])
    ok(plugins, ["sft", "--data", str(tmp_path / "csft.jsonl"), "--output-key", "response", "--out",
                 str(tmp_path / "csft"), *fit])
    ok(plugins, ["dpo", "--data", str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "dpo"), *fit])
    for run in ("sft", "csft", "dpo"):
        assert (tmp_path / run / "final" / "config.json").exists()


@pytest.mark.run
def test_rlhf_score_runs_a_reward_model_over_the_file_in_batches(plugins, job, tmp_path, tiny_model_dir):
    """Batched, padded reward-model scores equal one unpadded forward per prompt + completion."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(config).eval()
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    ok(plugins, job("plain.jsonl", reward=False))
    ok(plugins, ["score", "--data", str(tmp_path / "plain.jsonl"), "--reward", str(tmp_path / "rm"),
                 "--reward-rm-batch-size", "3", "--input-template", "Q: {} A:", "--out", str(tmp_path / "rm.jsonl"),
                 "--no-progress"])
    for row in read(tmp_path / "rm.jsonl"):
        for completion, reward in zip(row["completions"], row["rewards"], strict=True):
            ids = torch.tensor([tokenizer(f"Q: {row['prompt']} A:" + completion)["input_ids"]])
            with torch.no_grad():
                expected = float(rm(ids).logits[0, 0])
            assert reward == pytest.approx(expected, abs=1e-4)
