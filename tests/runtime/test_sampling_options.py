"""``--top-k`` and ``--repetition-penalty``: the hf engine's decoders (direct, lean, generate) sample
the distribution `SamplingParams` states, checked against a hand-written reference (a full forward
per step; the penalty over the prompt's tokens, not its padding, and the tokens generated so far;
then temperature, then the k largest), with the engine's log-probs those of that distribution;
the options reach every command and bad values are refused."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.protocols.rollout import SamplingParams
from rlhf.plugins.engines.hf import HFEngine, HFEngineConfig
from tests.helpers import run_cli

DECODERS = ("direct", "lean", "generate")


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def reference_logprobs(model, prompt: list[int], tokens: list[int], params: SamplingParams) -> list[float]:
    """log p(token_t) under the stated distribution, from a full forward of prompt + tokens[:t]."""
    out = []
    for t, token in enumerate(tokens):
        ids = torch.tensor([prompt + tokens[:t]])
        with torch.no_grad():
            z = model(ids).logits[0, -1].double()  # (V,)
        seen = torch.zeros_like(z, dtype=torch.bool)
        seen[ids[0]] = True
        p = params.repetition_penalty
        z = torch.where(seen, torch.where(z > 0, z / p, z * p), z)
        if params.temperature > 0:
            z = z / params.temperature
            if params.top_k:
                z = z.masked_fill(z < z.topk(params.top_k).values[-1], float("-inf"))
            if params.top_p < 1:  # the most likely tokens until their mass reaches top_p
                probs, order = torch.softmax(z, dim=-1).sort(descending=True)
                before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
                z[order[before >= params.top_p]] = float("-inf")
        out.append(float(torch.log_softmax(z, dim=-1)[token]))
    return out


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer("12+7=12+7=")["input_ids"], tokenizer("hi")["input_ids"]]  # different lengths: padding


@pytest.mark.run
@pytest.mark.parametrize("decoder", DECODERS)
def test_greedy_with_a_repetition_penalty_is_the_reference_argmax(model_and_tokenizer, decoder):
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_new_tokens=8, temperature=0.0, repetition_penalty=1.8, return_logprobs=True)
    plain = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine = HFEngine(model, tokenizer, HFEngineConfig(decoder=decoder))
    for prompt, generation, unpenalised in zip(prompts(tokenizer), engine.generate(prompts(tokenizer), n=1,
                                                                                    params=params),
                                               engine.generate(prompts(tokenizer), n=1, params=plain)):
        tokens = generation.token_ids
        expected = reference_logprobs(model, prompt, tokens, params)
        for t in range(len(tokens)):  # each token is the argmax of the penalised logits
            ids = torch.tensor([prompt + tokens[:t]])
            with torch.no_grad():
                z = model(ids).logits[0, -1].double()
            seen = torch.zeros_like(z, dtype=torch.bool)
            seen[ids[0]] = True
            z = torch.where(seen, torch.where(z > 0, z / 1.8, z * 1.8), z)
            assert int(z.argmax()) == tokens[t], (decoder, t)
        assert generation.logprobs == pytest.approx(expected, abs=1e-4)
        assert tokens != unpenalised.token_ids or len(set(tokens)) == len(tokens)  # the penalty acted


@pytest.mark.run
@pytest.mark.parametrize("decoder", DECODERS)
def test_sampled_tokens_come_from_top_k_and_top_p_and_the_engines_logprobs_are_theirs(model_and_tokenizer, decoder):
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=5, top_p=0.8, repetition_penalty=1.3,
                            return_logprobs=True)
    engine = HFEngine(model, tokenizer, HFEngineConfig(decoder=decoder))
    torch.manual_seed(0)
    generations = engine.generate(prompts(tokenizer), n=3, params=params)
    rows = [p for p in prompts(tokenizer) for _ in range(3)]
    for prompt, generation in zip(rows, generations):
        expected = reference_logprobs(model, prompt, generation.token_ids, params)
        assert all(value > float("-inf") for value in expected)  # every token among the k largest
        assert generation.logprobs == pytest.approx(expected, abs=1e-4), decoder


@pytest.mark.run
def test_top_k_of_one_is_greedy(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    greedy = engine.generate(prompts(tokenizer), n=1, params=SamplingParams(max_new_tokens=6, temperature=0.0))
    torch.manual_seed(5)
    top1 = engine.generate(prompts(tokenizer), n=2, params=SamplingParams(max_new_tokens=6, temperature=1.3, top_k=1))
    assert [g.token_ids for g in top1] == [g.token_ids for g in greedy for _ in range(2)]


@pytest.mark.unit
@pytest.mark.parametrize("command", ["train", "generate", "eval"])
@pytest.mark.parametrize("flag, value, message", [
    ("--top-k", "-1", "--top-k must be a whole number >= 0"),
    ("--repetition-penalty", "0", "--repetition-penalty must be positive"),
])
def test_bad_sampling_values_are_refused_before_any_model_loads(command, flag, value, message, task, tmp_path,
                                                                plugins):
    args = [command, "--model", str(tmp_path / "no-model"), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", "exact_match", flag, value]
    if command == "generate":
        args += ["--out", str(tmp_path / "out.jsonl")]
    result = run_cli(plugins, args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.run
def test_a_training_run_samples_with_them(tiny_model_dir, task, tmp_path, plugins):
    import yaml

    out = tmp_path / "run"
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--label-key", "answer", "--reward", "exact_match", "--n-samples", "2",
                               "--prompts-per-step", "2", "--max-new-tokens", "4", "--steps", "1", "--top-k", "3",
                               "--repetition-penalty", "1.2", "--policy-loss.correction", "tis", "--out", str(out),
                               "--no-progress"])
    assert result.exit_code == 0, result.output
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["top_k"], config["repetition_penalty"]) == (3, 1.2)
