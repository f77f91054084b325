"""``rlhf eval``, ``rlhf iterate`` and ``rlhf chat`` by value, on samples whose rewards are known
(tests/datagen/scripted.py) and a model whose answers are scripted:

* eval: every metric (mean, each source's mean, pass@1, pass@n, lengths, truncations, prompts)
  against the script by hand, with a source that abstains, over several batches; the rows of --out;
* iterate: each round samples from the previous round's model with its own seed and its own
  slice of the prompts (wrapping around), pairs each prompt's best against its worst sample
  (ties and unscored prompts skipped and counted), and records the round's metrics; the DPO run
  it starts gets the round's pairs, model and options;
* chat: the seed, the sampling options and the budget reach ``generate``; each turn's input is the
  history and the new message; /reset forgets the history."""

from __future__ import annotations

import io
import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from tests.datagen.scripted import LENGTH_ENDED, PROMPTS, REWARDS, SCRIPT, ScriptedEngine, scripted_plugin, value
from tests.helpers import read_jsonl, run_cli, write_jsonl

pytestmark = pytest.mark.run


@pytest.fixture
def plugins(plugins):
    plugins.register(scripted_plugin())
    ScriptedEngine.calls.clear()
    return plugins


@pytest.fixture
def files(tmp_path):
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def ok(plugins, args):
    result = run_cli(plugins, args)
    assert result.exit_code == 0, result.output
    return result


# --- rlhf eval ----------------------------------------------------------------------------------


def mean(values):
    return sum(values) / len(values)


def test_eval_reports_each_metric_as_computed_by_hand(plugins, files, tiny_model_dir):
    from transformers import AutoTokenizer

    reward = f"{files / 'rewards.py'}"
    result = ok(plugins, ["eval", "--model", str(tiny_model_dir), "--data", str(files / "prompts.jsonl"),
                          "--label-key", "answer", "--engine", "scripted", "--n-samples", "4", "--batch-size", "2",
                          "--reward", f"{reward}:score", "--reward", f"{reward}:bonus", "--max-new-tokens", "32",
                          "--json", "--out", str(files / "rows.jsonl")])
    metrics = json.loads(result.output.strip().splitlines()[-1])
    # by hand: score reads each sample's value; bonus gives 0.5 to every sample of p0 and p3 and abstains elsewhere
    score = {p: [None if v == "none" else float(v) for v in SCRIPT[p]] for p in SCRIPT}
    bonus = {p: [0.5 if p in ("p0", "p3") else None] * 4 for p in SCRIPT}
    total = {p: [None if s is None and b is None else (s or 0.0) + (b or 0.0) for s, b in zip(score[p], bonus[p])]
             for p in SCRIPT}
    assert total["p0"] == [1.5, 3.5, 3.5, 0.5] and total["p2"] == [None, 5.0, None, -1.0] and total["p3"] == [0.5] * 4
    scored = {p: [t for t in total[p] if t is not None] for p in SCRIPT}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    made = [c for call in ScriptedEngine.calls for c in call["completions"]]
    lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) + (i % 4 not in LENGTH_ENDED)
               for i, c in enumerate(made)]  # a sample's tokens, its EOS included
    expected = {
        "eval/prompts": 5.0,
        "eval/reward/mean": mean([t for p in SCRIPT for t in scored[p]]),
        "eval/reward/score": mean([s for p in SCRIPT for s in score[p] if s is not None]),
        "eval/reward/bonus": 0.5,
        "eval/pass@1": mean([mean(scored[p]) for p in SCRIPT]),
        "eval/pass@4": mean([max(scored[p]) for p in SCRIPT]),
        "eval/response/length_mean": mean(lengths),
        "eval/response/truncated_rate": len(LENGTH_ENDED) / 4,
        # how the samples ended (docs/outcomes.md): the length-ended ones truncated, the others ok, none failed
        "eval/outcome/ok_rate": 1 - len(LENGTH_ENDED) / 4, "eval/outcome/truncated_rate": len(LENGTH_ENDED) / 4,
        **{f"eval/outcome/{name}_rate": 0.0 for name in ("env_error", "reward_error", "tool_timeout", "agent_error",
                                                         "timeout", "stale", "drift")},
    }
    assert metrics.keys() == expected.keys()  # no eval/reward/env: the single-turn environment gives no rewards
    for name, number in expected.items():
        assert metrics[name] == pytest.approx(number, abs=1e-9), name
    assert [call["prompts"] for call in ScriptedEngine.calls] == [  # batches of --batch-size prompts, each sample
        ["p0"] * 4 + ["p1"] * 4, ["p2"] * 4 + ["p3"] * 4, ["p4"] * 4]  # a request of its own

    rows = read_jsonl(files / "rows.jsonl")
    assert len(rows) == 20
    for i, row in enumerate(rows):
        prompt = list(SCRIPT)[i // 4]
        assert row["prompt"] == prompt and row["label"] == f"a{i // 4}" and row["completion"] == made[i]
        assert row["reward"] == total[prompt][i % 4]
        assert row["rewards"] == {"score": score[prompt][i % 4], "bonus": bonus[prompt][i % 4]}
        assert row["finish_reason"] == ("length" if i % 4 in LENGTH_ENDED else "stop")


def test_eval_with_one_sample_reports_pass_at_1_only_and_is_seeded(plugins, files, tiny_model_dir):
    args = ["eval", "--model", str(tiny_model_dir), "--data", str(files / "prompts.jsonl"), "--label-key", "answer",
            "--engine", "scripted", "--n-samples", "1", "--reward", f"{files / 'rewards.py'}:score", "--json",
            "--seed", "9"]
    metrics = json.loads(ok(plugins, args).output.strip().splitlines()[-1])
    firsts = [float(SCRIPT[p][0]) for p in SCRIPT if SCRIPT[p][0] != "none"]
    assert metrics["eval/pass@1"] == pytest.approx(mean(firsts)) and "eval/pass@2" not in metrics
    assert not any(name.startswith("eval/pass@") and name != "eval/pass@1" for name in metrics)
    first = [c for call in ScriptedEngine.calls for c in call["completions"]]
    ScriptedEngine.calls.clear()
    ok(plugins, args)
    assert [c for call in ScriptedEngine.calls for c in call["completions"]] == first  # --seed: the same draws
    ScriptedEngine.calls.clear()
    ok(plugins, args[:-1] + ["10"])
    assert [c for call in ScriptedEngine.calls for c in call["completions"]] != first


# --- rlhf iterate -------------------------------------------------------------------------------


@pytest.fixture
def iterate_run(plugins, files, tiny_model_dir, monkeypatch):
    """``rlhf iterate`` with the scripted engine and DPO replaced by a stand-in that copies the
    starting model to ``dpo/final`` (and logs a loss); records what each round generated from."""
    import rlhf.datagen.generate as generate_module
    import rlhf.datagen.iterate as iterate_module

    generated, trained = [], []
    real_generate = generate_module.generate

    def recording_generate(config, *, plugins=None):
        generated.append(config)
        return real_generate(config, plugins=plugins)

    def fake_dpo(config, objective, start, pairs, run_dir, plugins):
        trained.append({"objective": objective.name, "start": start, "pairs": read_jsonl(pairs), "run_dir": run_dir})
        shutil.copytree(start, run_dir / "final")
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.25}\n')
        return run_dir / "final"

    monkeypatch.setattr(generate_module, "generate", recording_generate)
    monkeypatch.setattr(iterate_module, "_dpo", fake_dpo)
    args = ["iterate", "--model", str(tiny_model_dir), "--data", str(files / "prompts.jsonl"), "--label-key",
            "answer", "--reward", f"{files / 'rewards.py'}:score", "--engine", "scripted", "--n", "4", "--batch-size",
            "2", "--max-new-tokens", "6", "--seed", "5", "--rounds", "2", "--prompts-per-round", "3",
            "--out", str(files / "idpo"), "--no-progress"]
    ok(plugins, args)
    return types.SimpleNamespace(generated=generated, trained=trained, out=files / "idpo", args=args,
                                 plugins=plugins)


def test_each_round_samples_its_own_prompts_from_the_last_rounds_model_with_its_own_seed(iterate_run, tiny_model_dir):
    first, second = iterate_run.generated
    out = iterate_run.out
    assert (first.model, first.seed, second.seed) == (str(tiny_model_dir), 5, 6)
    assert second.model == str((out / "round_1" / "dpo" / "final").resolve())
    assert [row["prompt"] for row in read_jsonl(out / "round_1" / "prompts.jsonl")] == ["p0", "p1", "p2"]
    assert [row["prompt"] for row in read_jsonl(out / "round_2" / "prompts.jsonl")] == ["p3", "p4", "p0"]  # wraps
    assert first.data == [str(out / "round_1" / "prompts.jsonl")] and first.n == 4
    assert [t["start"] for t in iterate_run.trained] == [str(tiny_model_dir), second.model]
    assert [call["prompts"] for call in ScriptedEngine.calls] == [["p0", "p1"], ["p2"], ["p3", "p4"], ["p0"]]


def test_each_round_pairs_the_best_against_the_worst_sample_and_records_its_metrics(iterate_run):
    out = iterate_run.out
    for k, (pairs_by_hand, ties, unscored) in {1: ({"p0": (1, 3), "p2": (1, 3)}, 1, 0),
                                               2: ({"p4": (1, 0), "p0": (1, 3)}, 0, 1)}.items():
        generations = read_jsonl(out / f"round_{k}" / "generations.jsonl")
        by_prompt = {row["prompt"]: row for row in generations}
        expected = [{"prompt": p, "chosen": by_prompt[p]["completions"][c], "rejected": by_prompt[p]["completions"][r],
                     "chosen_reward": value(by_prompt[p]["completions"][c]),
                     "rejected_reward": value(by_prompt[p]["completions"][r])} for p, (c, r) in pairs_by_hand.items()]
        assert read_jsonl(out / f"round_{k}" / "pairs.jsonl") == expected
        assert iterate_run.trained[k - 1]["pairs"] == expected  # what DPO trained on
        rewards = [r for row in generations for r in row["rewards"] if r is not None]
        record = json.loads((out / f"round_{k}" / "round.json").read_text())
        assert record == {
            "round": k, "start_model": iterate_run.trained[k - 1]["start"],
            "model": str((out / f"round_{k}" / "dpo" / "final").resolve()),
            "reward/mean": pytest.approx(mean(rewards)),
            "reward/chosen_mean": pytest.approx(mean([e["chosen_reward"] for e in expected])),
            "reward/rejected_mean": pytest.approx(mean([e["rejected_reward"] for e in expected])),
            "pairs": len(expected), "skipped/ties": ties, "skipped/unscored": unscored, "dpo/step": 1,
            "dpo/train/loss": 0.25}
        assert (out / f"round_{k}" / "model").resolve() == (out / f"round_{k}" / "dpo" / "final").resolve()
    assert [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] == [
        json.loads((out / f"round_{k}" / "round.json").read_text()) for k in (1, 2)]


def test_a_rerun_of_a_finished_iterate_samples_and_trains_nothing(iterate_run):
    before = len(iterate_run.generated), len(iterate_run.trained)
    ok(iterate_run.plugins, iterate_run.args)
    assert (len(iterate_run.generated), len(iterate_run.trained)) == before


def test_the_dpo_round_gets_the_pairs_the_start_model_and_iterates_dpo_options(tmp_path, plugins, monkeypatch):
    import rlhf.runtime.fit.local as local
    from rlhf.datagen.config import IterateConfig
    from rlhf.datagen.iterate import _dpo, _objective

    seen = []

    def fake_fit(config, *, plugins=None):
        seen.append(config)
        (Path(config.out) / "final").mkdir(parents=True)
        (Path(config.out) / "final" / "config.json").write_text("{}")

    monkeypatch.setattr(local, "fit", fake_fit)
    config = IterateConfig(model="m0", data=["d.jsonl"], reward=["r.py"], out=str(tmp_path / "idpo"), beta=0.3,
                           lr=2e-6, epochs=2, dpo_batch_size=6, micro_batch_size=3, max_len=99, seed=17,
                           dpo_config=["label_smoothing=0.1", "save_every=4"])
    objective = _objective(config, plugins)
    assert objective.name == "dpo"  # the default --objective
    final = _dpo(config, objective, "round_1/model", tmp_path / "pairs.jsonl", tmp_path / "dpo", plugins)
    (fit_config,) = seen
    assert final == tmp_path / "dpo" / "final"
    assert (fit_config.objective, fit_config.model, fit_config.data, fit_config.out) == (
        "dpo", "round_1/model", [str(tmp_path / "pairs.jsonl")], str(tmp_path / "dpo"))
    assert (fit_config.lr, fit_config.epochs, fit_config.batch_size, fit_config.micro_batch_size, fit_config.max_len,
            fit_config.seed, fit_config.save_every) == (2e-6, 2, 6, 3, 99, 17, 4)
    assert fit_config.components["objective"] == {"beta": 0.3, "label_smoothing": 0.1}
    assert fit_config.resume is False
    _dpo(config, _objective(config, plugins), "round_1/model", tmp_path / "pairs.jsonl", tmp_path / "dpo", plugins)
    assert len(seen) == 1  # a round whose DPO model is written does not train again


# --- rlhf chat ----------------------------------------------------------------------------------


class ScriptedChatModel(torch.nn.Module):
    """Answers each turn with the next of ``answers`` (then EOS) and records how it was asked."""

    def __init__(self, tokenizer, answers, context=64):
        super().__init__()
        self.tokenizer, self.answers, self.calls = tokenizer, list(answers), []
        self.config = types.SimpleNamespace(max_position_embeddings=context)
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, **kwargs):
        self.calls.append({"ids": input_ids[0].tolist(), "seed": torch.initial_seed(), **kwargs})
        answer = self.tokenizer(self.answers.pop(0), add_special_tokens=False)["input_ids"]
        return torch.cat([input_ids, torch.tensor([answer + [self.tokenizer.eos_token_id]])], dim=1)


@pytest.fixture
def chat(tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    import rlhf.datagen.chat as chat_module

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def run(settings, lines, answers, context=64):
        model = ScriptedChatModel(tokenizer, answers, context)
        monkeypatch.setattr(chat_module, "load_model", lambda ref, settings: (model, tokenizer))
        out = io.StringIO()
        chat_module.run_chat("model", settings, stdin=io.StringIO("".join(line + "\n" for line in lines)), stdout=out)
        return model.calls, out.getvalue()

    run.tokenizer = tokenizer
    return run


def test_chat_turns_carry_the_history_and_reset_forgets_it(chat):
    from rlhf.datagen.chat import ChatSettings

    settings = ChatSettings(input_template="U: {}\nA: ", max_new_tokens=8, temperature=0.5, top_p=0.8, top_k=3,
                            repetition_penalty=1.2, seed=11)
    calls, output = chat(settings, ["hi", "", "again", "/reset", "fresh", "/exit", "never"],
                         [" one\n", " two\n", " three\n"])
    ids = lambda text: chat.tokenizer(text)["input_ids"]  # noqa: E731 (--input-template: the tokenizer's own specials)
    assert [call["ids"] for call in calls] == [ids("U: hi\nA: "), ids("U: hi\nA:  one\nU: again\nA: "),
                                               ids("U: fresh\nA: ")]
    assert "(conversation reset)" in output
    for call in calls:
        assert call["seed"] == 11  # --seed seeds torch before the first answer
        assert (call["do_sample"], call["temperature"], call["top_p"], call["top_k"]) == (True, 0.5, 0.8, 3)
        assert call["repetition_penalty"] == 1.2 and call["max_new_tokens"] == 8
        assert call["pad_token_id"] == chat.tokenizer.pad_token_id


def test_chat_at_temperature_0_is_greedy_and_an_answer_gets_what_the_context_leaves(chat):
    from rlhf.datagen.chat import ChatSettings

    calls, _ = chat(ChatSettings(input_template="{}", max_new_tokens=500, temperature=0.0), ["hello there"], [" ok"],
                    context=40)
    (call,) = calls
    assert call["do_sample"] is False and "temperature" not in call and "top_p" not in call
    assert call["max_new_tokens"] == 40 - len(call["ids"])
