"""A reward model trained with ``rlhf rm`` scores its training pairs the same wherever it is used.

The training-time score of a pair is what the ``rm`` objective computes: the scalar head's value at
the last token of prompt + response + EOS. The three ways the saved model scores texts must give
exactly that (normalised with the config.json's mean and std under ``--normalize-reward``):

* the ``rlhf.rewards.load_reward`` API;
* ``rlhf score`` on a file of prompts and completions;
* ``rlhf train --reward DIR``, the RL loop's reward source (here with a rollout engine that
  "generates" each pair's chosen and rejected responses, so the RL run scores the training pairs).

The training side is pinned twice: the mean chosen / rejected scores of the fit loop's own eval
pass on the training file at the last step (run with the final weights, before export), and the
``rm`` objective's ``scores`` on the exported model per pair. A score read one token off, in training
or in scoring (EOS not appended, or the value read at the token before), breaks the equalities.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.core.protocols.rollout import Generation
from tests.helpers import objective_scores, read_jsonl, run_cli, write_jsonl

pytestmark = pytest.mark.run

WORDS = ["cat", "hello world", "the quick brown fox", "12 + 7 = 19", "dog", "say hello", "jumps over", "lazy"]
PAIRS = [{"prompt": f"Q: {word}?", "chosen": word, "rejected": WORDS[(index + 3) % len(WORDS)]}
         for index, word in enumerate(WORDS)]


@pytest.fixture(scope="module")
def trained_rm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two steps of ``rlhf rm --normalize-reward`` on PAIRS, with an eval pass on the same file after
    the last step; the raw scores of every pair under the objective; the normalisation."""
    root = tmp_path_factory.mktemp("rm-train-score")
    pairs = write_jsonl(root / "pairs.jsonl", PAIRS)
    out = root / "rm"
    result = run_cli(build_plugin_manager(load_entrypoints=False), [
        "rm", "--model", str(tiny_model_dir), "--data", str(pairs), "--eval-data", str(pairs), "--normalize-reward",
        "--batch-size", "4", "--steps", "2", "--lr", "1e-2", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    last = read_jsonl(out / "metrics.jsonl")[-1]
    assert last["step"] == 2 and "eval/chosen_score" in last
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["reward_append_eos"] is True and config["normalize_reward"] is True
    raw = objective_scores(out / "final", pairs)
    return {"root": root, "final": out / "final", "pairs": pairs, "eval": last, "raw": raw,
            "mean": config["mean"], "std": config["std"]}


def check_against_training(trained_rm: dict, scored: list[tuple[float, float]]) -> None:
    """``scored``: the normalised (chosen, rejected) score of each pair of PAIRS from one scoring path."""
    mean, std = trained_rm["mean"], trained_rm["std"]
    # per pair: (raw training score − mean) / std
    expected = [((c - mean) / std, (r - mean) / std) for c, r in trained_rm["raw"]]
    assert [pytest.approx(pair, abs=1e-4) for pair in expected] == scored
    # the fit loop's own eval after the last step saw the same raw scores on average
    raw_back = [(c * std + mean, r * std + mean) for c, r in scored]
    assert statistics.fmean(c for c, _ in raw_back) == pytest.approx(trained_rm["eval"]["eval/chosen_score"], abs=1e-4)
    assert statistics.fmean(r for _, r in raw_back) == pytest.approx(trained_rm["eval"]["eval/rejected_score"],
                                                                     abs=1e-4)
    # mean and std were computed over the same training texts at the same token: the normalised
    # scores of every chosen and rejected text have mean 0 and (unbiased) std 1
    flat = [value for pair in scored for value in pair]
    assert statistics.fmean(flat) == pytest.approx(0.0, abs=1e-4)
    assert statistics.stdev(flat) == pytest.approx(1.0, abs=1e-4)
    assert len({round(value, 3) for value in flat}) > 4  # the texts really score differently


def test_the_training_scores_are_the_eval_pass_scores(trained_rm):
    """The objective's per-pair scores on the exported model average to the eval metrics the loop
    reported with the final weights (so the export and reload change nothing)."""
    raw = trained_rm["raw"]
    assert statistics.fmean(c for c, _ in raw) == pytest.approx(trained_rm["eval"]["eval/chosen_score"], abs=1e-5)
    assert statistics.fmean(r for _, r in raw) == pytest.approx(trained_rm["eval"]["eval/rejected_score"], abs=1e-5)


def test_load_reward_scores_the_training_pairs_as_training_did(trained_rm):
    from rlhf.rewards import load_reward

    source = load_reward(str(trained_rm["final"]), plugins=build_plugin_manager(load_entrypoints=False),
                         rm_batch_size=3)  # batches that pad, and cut across pairs
    prompts = [row["prompt"] for row in PAIRS]
    chosen = source.score(prompts, [row["chosen"] for row in PAIRS])
    rejected = source.score(prompts, [row["rejected"] for row in PAIRS])
    check_against_training(trained_rm, list(zip(chosen, rejected)))


def test_rlhf_score_scores_the_training_pairs_as_training_did(trained_rm):
    root = trained_rm["root"]
    rows = write_jsonl(root / "to-score.jsonl", [{"prompt": row["prompt"], "completions": [row["chosen"],
                                                                                       row["rejected"]]}
                                                 for row in PAIRS])
    out = root / "scored.jsonl"
    result = run_cli(build_plugin_manager(load_entrypoints=False), [
        "score", "--data", str(rows), "--reward", str(trained_rm["final"]), "--batch-size", "3",
        "--out", str(out), "--overwrite", "--no-progress"])
    assert result.exit_code == 0, result.output
    scored = {row["prompt"]: tuple(row["rewards"]) for row in read_jsonl(out)}
    check_against_training(trained_rm, [scored[row["prompt"]] for row in PAIRS])


class PairsEngine:
    """A rollout engine that answers a PAIRS prompt with its chosen response the first time it is
    asked, its rejected one the second (``--n-samples 2``: the runtime asks for each copy of a prompt
    on its own), and so on; each ends with EOS as a generated response does."""

    shares_weights = True

    def __init__(self, model, tokenizer, config=None):
        self.tokenizer = tokenizer
        self.asked: dict[str, int] = {}

    def generate(self, prompts, *, n, params):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            (row,) = [row for row in PAIRS if text.endswith(row["prompt"])]
            for _ in range(n):
                times = self.asked[row["prompt"]] = self.asked.get(row["prompt"], 0) + 1
                response = row["chosen"] if times % 2 else row["rejected"]
                tokens = self.tokenizer(response, add_special_tokens=False)["input_ids"]
                out.append(Generation(token_ids=tokens + [self.tokenizer.eos_token_id], finish_reason="stop"))
        return out

    def load_weights(self, state=None):
        """The answers do not depend on the policy."""


def test_rlhf_train_with_the_reward_model_scores_the_training_pairs_as_training_did(
        trained_rm, tiny_model_dir, make_plugin):
    """One RL step over every PAIRS prompt with ``--reward DIR``: samples.jsonl holds the reward
    the RL loop gave each chosen and rejected response."""
    root = trained_rm["root"]
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": row["prompt"]} for row in PAIRS])
    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(make_plugin("pairs_engine", register_rollout_engines=lambda register: register(
        "pairs", PairsEngine)))
    out = root / "rl"
    result = run_cli(plugins, [
        "train", "--model", str(tiny_model_dir), "--data", str(prompts), "--reward", str(trained_rm["final"]),
        "--engine", "pairs", "--prompts-per-step", str(len(PAIRS)), "--n-samples", "2", "--max-new-tokens", "16",
        "--micro-batch-size", "16", "--steps", "1", "--lr", "1e-6", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    rewards: dict[tuple[str, str], float] = {}
    for sample in read_jsonl(out / "samples.jsonl"):
        assert sample["reward"] == sample["rewards"]["final"]  # the one reward source: the model in final/
        rewards[sample["prompt"], sample["completion"]] = sample["reward"]
    assert len(rewards) == 2 * len(PAIRS)
    check_against_training(trained_rm, [(rewards[row["prompt"], row["chosen"]],
                                         rewards[row["prompt"], row["rejected"]]) for row in PAIRS])


def test_a_tokenizer_that_adds_bos_scores_as_it_trained(tiny_model_dir, tmp_path):
    """Training encodes prompt + response + EOS without special tokens; a scorer that let the
    tokenizer add its BOS (as Llama's do) would read a different sequence."""
    import shutil

    from tokenizers import processors
    from transformers import AutoTokenizer

    from rlhf.rewards import load_reward

    model_dir = tmp_path / "bos-model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    tokenizer.save_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir)("cat")["input_ids"][0] == tokenizer.bos_token_id
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "rm"
    result = run_cli(build_plugin_manager(load_entrypoints=False), [
        "rm", "--model", str(model_dir), "--data", str(pairs), "--batch-size", "4", "--steps", "1", "--lr", "1e-2",
        "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    raw = objective_scores(out / "final", pairs)
    source = load_reward(str(out / "final"), plugins=build_plugin_manager(load_entrypoints=False))
    prompts = [row["prompt"] for row in PAIRS]
    chosen = source.score(prompts, [row["chosen"] for row in PAIRS])
    rejected = source.score(prompts, [row["rejected"] for row in PAIRS])
    assert list(zip(chosen, rejected)) == [pytest.approx(pair, abs=1e-4) for pair in raw]
