"""The ``vllm`` engine's pure mappings: our SamplingParams to vLLM's, prompts to rows, vLLM's
completions to Generations, the LLM's arguments from the run's config. No vLLM needed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf.core.errors import ConfigError
from rlhf.core.protocols.rollout import Generation, SamplingParams
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.plugins.engines.vllm_engine import (VLLMEngineConfig, eos_token_ids, expand_prompts, llm_kwargs,
                                              sampled_logprobs, sampling_kwargs, to_generation, validate)
from rlhf.runtime.config.train_plan import RunPlan
from tests.vllm.fakes import Completion, Logprob

pytestmark = pytest.mark.unit

# --- sampling parameters ---------------------------------------------------------------------


def test_sampling_params_keep_only_temperature_and_top_p():
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, stop=("```", "\n\n"), return_logprobs=True)
    assert sampling_kwargs(params, {7, 2}) == dict(
        n=1, temperature=0.7, top_p=0.9, top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
        repetition_penalty=1.0, min_tokens=0, max_tokens=5, stop=["```", "\n\n"], stop_token_ids=[2, 7],
        ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False, detokenize=True, logprobs=0)


def test_top_k_and_the_repetition_penalty_reach_vllm_and_greedy_keeps_the_penalty():
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=20, repetition_penalty=1.3)
    got = sampling_kwargs(params, {2})
    assert (got["top_k"], got["repetition_penalty"], got["min_p"], got["presence_penalty"]) == (20, 1.3, 0.0, 0.0)
    greedy = sampling_kwargs(SamplingParams(max_new_tokens=5, temperature=0.0, top_k=20, repetition_penalty=1.3), {2})
    assert (greedy["top_k"], greedy["repetition_penalty"]) == (0, 1.3)  # as the hf engine: penalised argmax


def test_greedy_sampling_params_and_no_logprobs():
    params = SamplingParams(max_new_tokens=3, temperature=0.0, top_p=0.5)
    got = sampling_kwargs(params, {2})
    assert (got["temperature"], got["top_p"], got["logprobs"], got["stop"], got["detokenize"]) == (0.0, 1.0, None,
                                                                                                   None, False)


def test_prompts_are_repeated_n_times_contiguously():
    prompts = [[1, 2], [3]]
    rows = expand_prompts(prompts, 3)
    assert rows == [[1, 2], [1, 2], [1, 2], [3], [3], [3]]
    rows[0].append(9)  # rows are copies: vLLM may keep them
    assert prompts == [[1, 2], [3]] and rows[1] == [1, 2]


# --- outputs ---------------------------------------------------------------------------------

EOS = {2, 7}


def test_eos_ends_with_stop_and_keeps_the_eos_token():
    gen = to_generation(Completion(token_ids=[5, 6, 7], finish_reason="stop"), EOS, False)
    assert gen == Generation(token_ids=[5, 6, 7], finish_reason="stop", logprobs=None, stop_string=None)


def test_eos_as_the_last_token_of_the_budget_is_a_stop():
    # vLLM checks the length first in some releases and calls this "length"
    gen = to_generation(Completion(token_ids=[5, 2], finish_reason="length"), EOS, False)
    assert (gen.finish_reason, gen.stop_string, gen.token_ids) == ("stop", None, [5, 2])


def test_stop_string_is_reported_with_the_tokens_that_made_it():
    gen = to_generation(Completion(token_ids=[5, 6], finish_reason="stop", stop_reason="```"), EOS, False)
    assert (gen.token_ids, gen.finish_reason, gen.stop_string) == ([5, 6], "stop", "```")


def test_budget_spent_is_length():
    gen = to_generation(Completion(token_ids=[5, 6, 8], finish_reason="length"), EOS, False)
    assert (gen.finish_reason, gen.stop_string) == ("length", None)


def test_unknown_finish_reason_is_an_error():
    with pytest.raises(RuntimeError, match="abort"):
        to_generation(Completion(token_ids=[5], finish_reason="abort"), EOS, False)


def test_logprobs_of_the_sampled_tokens():
    positions = [{5: Logprob(-0.5)}, {9: Logprob(-0.1, rank=1), 6: Logprob(-1.25, rank=3)}, {7: Logprob(-2.0)}]
    gen = to_generation(Completion(token_ids=[5, 6, 7], finish_reason="stop", logprobs=positions), EOS, True)
    assert gen.logprobs == [-0.5, -1.25, -2.0]


def test_logprobs_from_a_flat_container():
    class Flat:  # like vLLM's FlatLogprobs: a sequence whose items map token id -> Logprob
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    assert sampled_logprobs(Flat([{3: Logprob(-0.75)}, {4: Logprob(-0.125)}]), [3, 4]) == [-0.75, -0.125]


def test_logprob_positions_must_match_the_tokens():
    with pytest.raises(AssertionError, match="1 log-prob positions for 2 tokens"):
        sampled_logprobs([{3: Logprob(-0.75)}], [3, 4])


# --- construction ----------------------------------------------------------------------------


def test_config_receives_the_run_values_its_run_fields_declare(plugins):
    run = TrainConfig(model="m", data=["d"], engine="vllm", dtype="bf16", seed=3, tokenizer="tok",
                      max_prompt_length=100, max_new_tokens=20, max_turns=2, trust_remote_code=True)
    config = RunPlan.make(run, plugins).component_config("engine")
    assert (config.dtype, config.seed, config.tokenizer, config.trust_remote_code) == ("bf16", 3, "tok", True)
    assert (config.max_prompt_length, config.max_new_tokens, config.max_turns, config.max_total_tokens) == \
        (100, 20, 2, 100 + 2 * 20)  # the trajectory token budget, resolved
    # the engine's own settings keep their defaults; run fields have no flag of their own
    assert config.gpu_memory_utilization == VLLMEngineConfig().gpu_memory_utilization
    with pytest.raises(Exception, match=r"receives seed from the run"):
        RunPlan.make(dataclasses.replace(run, engine_config=["seed=5"]), plugins)


def tiny_policy(name_or_path: str = "/models/tiny", dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, eos_token_id=[2, 3])
    model = LlamaForCausalLM(config).to(dtype)
    model.config._name_or_path = name_or_path
    return model


def test_llm_arguments_from_the_policy_and_the_run_budget():
    got = llm_kwargs(VLLMEngineConfig(max_prompt_length=100, max_new_tokens=20, max_turns=3, seed=5), tiny_policy())
    assert got == dict(model="/models/tiny", tokenizer="/models/tiny", dtype="bfloat16", trust_remote_code=False,
                       seed=5, tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=160,
                       enable_prefix_caching=True, enforce_eager=False, enable_sleep_mode=False,
                       logprobs_mode="processed_logprobs", generation_config="vllm")


def test_llm_arguments_overrides():
    config = VLLMEngineConfig(vllm_model_path="/ckpt", tokenizer="/tok", dtype="fp16", max_total_tokens=300,
                              max_model_len=None)
    got = llm_kwargs(config, tiny_policy(dtype=torch.float32))
    assert (got["model"], got["tokenizer"], got["dtype"], got["max_model_len"]) == ("/ckpt", "/tok", "float16", 300)
    assert llm_kwargs(VLLMEngineConfig(max_model_len=64, max_total_tokens=300), tiny_policy())["max_model_len"] == 64


def test_a_policy_without_a_known_checkpoint_needs_a_path():
    with pytest.raises(ConfigError, match="vllm_model_path"):
        llm_kwargs(VLLMEngineConfig(), tiny_policy(name_or_path=""))


def test_eos_follows_the_generation_config_then_the_tokenizer():
    class Tokenizer:
        eos_token_id = 9

    model = tiny_policy()
    model.generation_config.eos_token_id = [2, 3]
    assert eos_token_ids(model, Tokenizer()) == {2, 3}
    model.generation_config.eos_token_id = None
    assert eos_token_ids(model, Tokenizer()) == {9}


@pytest.mark.parametrize("changes, message", [
    (dict(auto_sleep=True), "auto_sleep needs enable_sleep_mode"),
    (dict(sleep_level=3), "sleep_level must be 1 or 2"),
    (dict(dtype="int8"), "dtype must be auto or one of"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(sync_bucket_mb=0), "sync_bucket_mb"),
])
def test_bad_settings_are_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        validate(VLLMEngineConfig(**changes))
    validate(VLLMEngineConfig())
