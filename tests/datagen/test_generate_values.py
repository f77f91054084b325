"""``rlhf generate`` and ``rlhf score`` by value, on an engine whose samples say what they are
(tests/datagen/scripted.py: each sample carries its reward and a number drawn from the random
stream): the rows of each mode, field by field, against the script by hand; how many samples and
rows; which samples are chosen on ties and abstentions; the seeding (the same seed gives the same
file, another seed another, each batch and each sample a stream of its own, a resumed file the
same bytes); the engine's sampling settings; and ``rlhf score`` over a file written by hand."""

from __future__ import annotations

import json

import pytest
import torch

from tests.datagen.scripted import PROMPTS, REWARDS, SCRIPT, ScriptedEngine, draw, scripted_plugin, value
from tests.helpers import read_jsonl, run_cli, write_jsonl

pytestmark = pytest.mark.run


@pytest.fixture
def plugins(plugins):
    plugins.register(scripted_plugin())
    ScriptedEngine.calls.clear()
    return plugins


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    (tmp_path / "rewards.py").write_text(REWARDS)

    def args(out: str, *extra: str, reward: bool = True, data: str = "prompts.jsonl") -> list[str]:
        return (["generate", "--model", str(tiny_model_dir), "--data", str(tmp_path / data), "--label-key", "answer",
                 "--engine", "scripted", "--n", "4", "--batch-size", "2", "--max-new-tokens", "6", "--seed", "3",
                 "--out", str(tmp_path / out), "--no-progress"]
                + (["--reward", f"{tmp_path / 'rewards.py'}:score"] if reward else []) + list(extra))
    return args


def ok(plugins, args):
    result = run_cli(plugins, args)
    assert result.exit_code == 0, result.output
    return result


def scripted_values(prompt: str) -> list[float | None]:
    return [None if v == "none" else float(v) for v in SCRIPT[prompt]]


def test_samples_rows_hold_every_completion_its_reward_the_label_and_the_columns(plugins, job, tmp_path):
    result = ok(plugins, job("all.jsonl"))
    rows = read_jsonl(tmp_path / "all.jsonl")
    assert "5 row(s) for 5 prompt(s)" in result.output
    made = [c for call in ScriptedEngine.calls for c in call["completions"]]
    assert [row["prompt"] for row in rows] == list(SCRIPT)  # one row per prompt, in data order
    for i, row in enumerate(rows):
        assert list(row) == ["prompt", "completions", "rewards", "label", "answer", "topic"]
        assert row["completions"] == made[4 * i:4 * i + 4]  # the engine's samples of this prompt, decoded, in order
        assert row["rewards"] == scripted_values(row["prompt"])  # each sample's own reward, abstentions as null
        assert row["label"] == row["answer"] == f"a{i}" and row["topic"] == "t"
    # batches of --batch-size prompts, --n samples each, the sampling options as given
    assert [call["prompts"] for call in ScriptedEngine.calls] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    assert {call["n"] for call in ScriptedEngine.calls} == {4}


def test_the_sampling_options_reach_the_engine(plugins, job):
    ok(plugins, job("x.jsonl", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--repetition-penalty",
                    "1.3", "--max-new-tokens", "9", reward=False))
    params = ScriptedEngine.calls[0]["params"]
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        9, 0.7, 0.9, 5, 1.3)


def test_without_a_reward_rows_have_no_rewards(plugins, job, tmp_path):
    ok(plugins, job("plain.jsonl", reward=False))
    rows = read_jsonl(tmp_path / "plain.jsonl")
    assert [list(row) for row in rows] == [["prompt", "completions", "label", "answer", "topic"]] * 5


def test_best_of_n_keeps_the_highest_reward_the_first_of_a_tie_never_an_abstention(plugins, job, tmp_path):
    result = ok(plugins, job("best.jsonl", "--best-of-n"))
    made = [c for call in ScriptedEngine.calls for c in call["completions"]]
    expected = {"p0": 1, "p1": 0, "p2": 1, "p4": 1}  # the sample chosen, by hand from SCRIPT (p3: nothing scored)
    assert read_jsonl(tmp_path / "best.jsonl") == [
        {"prompt": p, "response": made[4 * list(SCRIPT).index(p) + s], "reward": scripted_values(p)[s]}
        for p, s in expected.items()]
    assert "4 row(s) for 5 prompt(s)" in result.output and "1 skipped (no sample was scored)" in result.output


def test_pairs_take_the_best_against_the_worst_and_skip_ties_and_unscored_prompts(plugins, job, tmp_path):
    result = ok(plugins, job("pairs.jsonl", "--pairs"))
    made = [c for call in ScriptedEngine.calls for c in call["completions"]]
    expected = {"p0": (1, 3), "p2": (1, 3), "p4": (1, 0)}  # (chosen, rejected) by hand; p1 ties, p3 unscored
    rows = read_jsonl(tmp_path / "pairs.jsonl")
    assert rows == [{"prompt": p, "chosen": made[4 * list(SCRIPT).index(p) + c],
                     "rejected": made[4 * list(SCRIPT).index(p) + r], "chosen_reward": scripted_values(p)[c],
                     "rejected_reward": scripted_values(p)[r]} for p, (c, r) in expected.items()]
    assert all(row["chosen_reward"] > row["rejected_reward"] for row in rows)
    assert "3 row(s) for 5 prompt(s)" in result.output
    assert "1 skipped (all their samples tie)" in result.output and "1 skipped (no sample was scored)" in result.output


def test_conditional_rows_carry_each_samples_score_in_the_prompt(plugins, job, tmp_path):
    ok(plugins, job("every.jsonl", "--conditional", "--conditional-rows", "sample", "--reward-template",
                    "<{reward}> {input}"))
    made = [c for call in ScriptedEngine.calls for c in call["completions"]]
    expected = [{"prompt": f"<{v:.2f}> {p}", "response": made[4 * i + s], "reward": v}
                for i, p in enumerate(SCRIPT) for s, v in enumerate(scripted_values(p)) if v is not None]
    assert read_jsonl(tmp_path / "every.jsonl") == expected
    ScriptedEngine.calls.clear()
    ok(plugins, job("one.jsonl", "--conditional"))  # one scored sample per prompt, drawn (seeded)
    one = read_jsonl(tmp_path / "one.jsonl")
    assert [row["prompt"].split(" <rm_score>: ")[0] for row in one] == ["p0", "p1", "p2", "p4"]
    made = [c for call in ScriptedEngine.calls for c in call["completions"]]
    for row in one:
        prompt = row["prompt"].split(" ")[0]
        assert row["prompt"] == f"{prompt} <rm_score>: {row['reward']:.2f} "
        assert row["response"] in made and value(row["response"]) == row["reward"] is not None
        assert made.index(row["response"]) // 4 == list(SCRIPT).index(prompt)  # a sample of its own prompt


def test_the_same_seed_gives_the_same_file_another_seed_other_samples(plugins, job, tmp_path):
    ok(plugins, job("a.jsonl"))
    ok(plugins, job("b.jsonl"))
    ok(plugins, job("c.jsonl", "--seed", "4"))
    a, b, c = (read_jsonl(tmp_path / f"{name}.jsonl") for name in "abc")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    draws = lambda rows: [draw(t) for row in rows for t in row["completions"]]  # noqa: E731
    assert not set(draws(a)) & set(draws(c))  # nothing drawn alike
    assert [row["rewards"] for row in a] == [row["rewards"] for row in c]  # the same script, only the draws differ


def test_each_batch_and_each_sample_draws_from_a_stream_of_its_own(plugins, job, tmp_path):
    """The same prompt in every batch: its samples differ from batch to batch (each batch is
    seeded by the seed and its index), from seed to seed, and within a prompt."""
    write_jsonl(tmp_path / "same.jsonl", [PROMPTS[0]] * 6)
    streams = {}
    for seed in ("1", "2", "3"):
        ok(plugins, job(f"s{seed}.jsonl", "--seed", seed, "--batch-size", "1", reward=False, data="same.jsonl"))
        for b, row in enumerate(read_jsonl(tmp_path / f"s{seed}.jsonl")):
            draws = [draw(t) for t in row["completions"]]
            assert len(set(draws)) == 4, draws  # the samples of one prompt are four draws, not one
            streams[seed, b] = tuple(draws)
    assert len(set(streams.values())) == 3 * 6  # (seed, batch) pairs never share a stream


def test_a_batch_draws_what_its_seed_says_whatever_ran_before_it(plugins, job, tmp_path):
    """The file cut back to its first batch and continued (the global random stream elsewhere) is
    the uninterrupted file, byte for byte."""
    ok(plugins, job("whole.jsonl"))
    whole = (tmp_path / "whole.jsonl").read_bytes()
    ok(plugins, job("cut.jsonl"))
    log = tmp_path / "cut.jsonl.progress.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    first = json.loads(lines[1])  # the record after the settings line: before any batch
    assert first["items"] == 0
    after_batch_one = json.loads(lines[2])
    assert after_batch_one["items"] == 2
    log.write_text("".join(lines[:3]))
    (tmp_path / "cut.jsonl").write_bytes(whole[:after_batch_one["bytes"]])
    torch.manual_seed(12345)  # the global stream elsewhere: the job seeds each batch itself
    ScriptedEngine.calls.clear()
    ok(plugins, job("cut.jsonl"))
    assert (tmp_path / "cut.jsonl").read_bytes() == whole
    assert [call["prompts"] for call in ScriptedEngine.calls] == [["p2", "p3"], ["p4"]]  # only what the file lacked


def test_a_rerun_of_a_finished_file_samples_nothing(plugins, job, tmp_path):
    ok(plugins, job("done.jsonl"))
    before = (tmp_path / "done.jsonl").read_bytes()
    ScriptedEngine.calls.clear()
    result = ok(plugins, job("done.jsonl"))
    assert "5 row(s) for 5 prompt(s)" in result.output and "already complete" in result.output
    assert ScriptedEngine.calls == [] and (tmp_path / "done.jsonl").read_bytes() == before


# --- rlhf score -------------------------------------------------------------------------------------


GENERATIONS = [
    {"prompt": "q0", "completions": [" r=1 #0", " r=4 #1", " r=4 #2"], "label": "x", "id": 0},
    {"prompt": "q1", "completions": [" r=none #0", " r=-2 #1", " r=7 #2"], "label": "y", "id": 1},
    {"prompt": "q2", "completions": [" r=3 #0", " r=3 #1", " r=3 #2"], "label": "z", "id": 2},
    {"prompt": "q3", "completions": [" r=none #0", " r=none #1", " r=none #2"], "label": "w", "id": 3},
]


@pytest.fixture
def score_job(tmp_path):
    write_jsonl(tmp_path / "gen.jsonl", GENERATIONS)
    write_jsonl(tmp_path / "single.jsonl", [{"prompt": r["prompt"], "response": r["completions"][1], "k": i}
                                            for i, r in enumerate(GENERATIONS)])
    (tmp_path / "rewards.py").write_text(REWARDS)

    def args(out: str, *extra: str, data: str = "gen.jsonl", reward: str = "score") -> list[str]:
        return ["score", "--data", str(tmp_path / data), "--reward", f"{tmp_path / 'rewards.py'}:{reward}",
                "--out", str(tmp_path / out), "--no-progress", *extra]
    return args


@pytest.mark.parametrize("batch_size", ["1", "3", "64"])
def test_score_writes_each_completions_reward_and_keeps_every_column(plugins, score_job, tmp_path, batch_size):
    result = ok(plugins, score_job("scored.jsonl", "--batch-size", batch_size))
    assert read_jsonl(tmp_path / "scored.jsonl") == [
        {**row, "rewards": [value(c) for c in row["completions"]]} for row in GENERATIONS]
    assert "4 row(s) for 4 prompt(s)" in result.output


def test_score_of_one_completion_per_row_writes_one_reward_and_weights_add_up(plugins, score_job, tmp_path):
    reward = f"{tmp_path / 'rewards.py'}:score"
    ok(plugins, score_job("one.jsonl", "--completions-key", "response", "--reward", f"{reward}@2",
                          data="single.jsonl", reward="score@0.5"))
    rows = read_jsonl(tmp_path / "one.jsonl")
    expected = [None if value(r["completions"][1]) is None else 2.5 * value(r["completions"][1]) for r in GENERATIONS]
    assert [row["reward"] for row in rows] == pytest.approx(expected)
    assert [set(row) for row in rows] == [{"prompt", "response", "k", "reward"}] * 4


def test_score_selections_are_generates(plugins, score_job, tmp_path):
    """--pairs / --best-of-n over the scored file: best against worst, the first of a tie, ties
    and unscored rows skipped (by hand)."""
    ok(plugins, score_job("pairs.jsonl", "--pairs", "--batch-size", "3"))
    assert read_jsonl(tmp_path / "pairs.jsonl") == [
        {"prompt": "q0", "chosen": " r=4 #1", "rejected": " r=1 #0", "chosen_reward": 4.0, "rejected_reward": 1.0},
        {"prompt": "q1", "chosen": " r=7 #2", "rejected": " r=-2 #1", "chosen_reward": 7.0, "rejected_reward": -2.0}]
    result = ok(plugins, score_job("best.jsonl", "--best-of-n"))
    assert read_jsonl(tmp_path / "best.jsonl") == [
        {"prompt": "q0", "response": " r=4 #1", "reward": 4.0}, {"prompt": "q1", "response": " r=7 #2", "reward": 7.0},
        {"prompt": "q2", "response": " r=3 #0", "reward": 3.0}]
    assert "1 skipped (no sample was scored)" in result.output


def test_score_passes_the_label_column_generate_wrote(plugins, score_job, tmp_path):
    (tmp_path / "labels.py").write_text("def echo(completions, labels, **kwargs):\n"
                                        "    return [float(ord(l)) for l in labels]\n")
    ok(plugins, ["score", "--data", str(tmp_path / "gen.jsonl"), "--reward", f"{tmp_path / 'labels.py'}:echo",
                 "--out", str(tmp_path / "labels.jsonl"), "--no-progress"])
    assert [row["rewards"] for row in read_jsonl(tmp_path / "labels.jsonl")] == [
        [float(ord(row["label"]))] * 3 for row in GENERATIONS]


def test_score_draws_the_conditional_sample_by_seed_and_row_not_by_batch(plugins, score_job, tmp_path):
    """--conditional-rows prompt picks one scored sample per row, seeded by --seed and the row's
    place in the data: the same file whatever --batch-size, another pick for another seed."""
    picks = {}
    for seed in ("1", "2", "3", "4"):
        for batch_size in ("1", "3"):
            out = f"c{seed}-{batch_size}.jsonl"
            ok(plugins, score_job(out, "--conditional", "--seed", seed, "--batch-size", batch_size))
            picks[seed, batch_size] = read_jsonl(tmp_path / out)
        assert picks[seed, "1"] == picks[seed, "3"]
        for row in picks[seed, "1"]:
            prompt = row["prompt"].split(" <rm_score>: ")[0]
            source = next(r for r in GENERATIONS if r["prompt"] == prompt)
            assert row["response"] in source["completions"] and value(row["response"]) == row["reward"]
    assert [row["prompt"].split(" ")[0] for row in picks["1", "1"]] == ["q0", "q1", "q2"]  # q3: nothing scored
    assert len({tuple(row["response"] for row in picks[seed, "1"]) for seed in ("1", "2", "3", "4")}) > 1
