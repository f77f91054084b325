"""The speed work's fast paths give the results of the slow paths they replace (issue 11).

- returns-to-go with γ = 1 and one reward per row: a reverse cumsum, bit for bit the loop;
- the engine's direct decoder: greedy tokens equal ``model.generate``'s, sampled tokens follow
  the model's softmax (inverse-CDF sampling on a CPU), the model's own generation config does
  not leak into either decoder, stop strings still go through ``generate``;
- the fused AdamW of the torch backend steps like the plain one;
- ``token_logprobs`` at temperature 1 and through a PEFT wrapper (logits only where needed).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.core.protocols.rollout import SamplingParams
from rlhf.core.types import Trajectory
from rlhf.plugins.algorithms.returns import discounted_returns
from rlhf.plugins.backends.torch_backend import BackendConfig, TorchBackend
from rlhf.core.batch import collate
from rlhf.plugins.engines.hf import HFEngine, HFEngineConfig, sample_categorical
from rlhf.core.logprobs import token_logprobs
from tests.helpers import assert_engine_logprobs_are_the_trainers


def loop_returns(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sequential γ = 1 recursion G_t = m_t R_t + G_{t+1}, written out independently."""
    rewards = torch.where(mask.bool(), rewards, torch.zeros((), dtype=rewards.dtype))
    out, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + 1.0 * running
        out[:, t] = running
    return out


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unit_gamma_outcome_returns_equal_the_loop_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(0)
    rows, width = 12, 9
    mask = (torch.rand(rows, width, generator=generator) < 0.7).to(dtype)  # multi-turn holes, some rows empty
    rewards = torch.zeros(rows, width, dtype=dtype)
    last = torch.randint(0, width, (rows,), generator=generator)
    rewards[torch.arange(rows), last] = torch.randn(rows, generator=generator, dtype=dtype) * 1e3
    rewards[0, last[0]] = -0.0
    rewards[1, last[1]] = float("nan")
    rewards[2, last[2]] = float("-inf")
    rewards[3, :] = 0.0
    returns = discounted_returns(rewards, mask, 1.0)
    expected = loop_returns(rewards, mask)
    assert torch.equal(returns.isnan(), expected.isnan())
    assert torch.equal(returns.nan_to_num(), expected.nan_to_num())
    assert torch.equal(returns.signbit(), expected.signbit())
    # The hand value: the reward reaches every position up to its own, 0 after it.
    row = 5
    assert returns[row, : last[row] + 1].tolist() == [float(rewards[row, last[row]] * mask[row, last[row]])] * (
        int(last[row]) + 1)


@pytest.mark.unit
def test_returns_with_many_nonzero_terms_keep_the_sequential_sum():
    rewards = torch.tensor([[1e8, 1.0, 1.0, 1.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float32)  # KL-like terms
    mask = torch.ones_like(rewards)
    returns = discounted_returns(rewards, mask, 1.0)
    assert torch.equal(returns, loop_returns(rewards, mask))
    assert returns[1].tolist() == pytest.approx([1.0, 0.9, 0.7, 0.4])


@pytest.mark.unit
def test_inverse_cdf_sampling_follows_the_probabilities_and_skips_zeros():
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.125, 0.125, 0.0])  # zeros first, inside and last
    draws = sample_categorical(probs.expand(200_000, -1))
    counts = torch.bincount(draws, minlength=probs.numel()).double() / draws.numel()
    assert counts[probs == 0].sum() == 0
    sigma = (probs * (1 - probs) / draws.numel()).sqrt()
    assert ((counts - probs).abs() <= 5 * sigma + 1e-12).all(), counts
    # rows that do not sum to one (top-p leftovers are renormalised by softmax, but be robust anyway)
    scaled = sample_categorical(torch.tensor([[0.0, 0.0, 3e-8], [2.0, 0.0, 0.0]]))
    assert scaled.tolist() == [2, 0]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def _engines(model, tokenizer):
    return {name: HFEngine(model, tokenizer, HFEngineConfig(decoder=name)) for name in ("direct", "generate")}


@pytest.mark.unit
def test_direct_decoder_is_chosen_unless_stop_strings_need_generate(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    assert engine.uses_direct_decoder(SamplingParams(max_new_tokens=4))
    assert not engine.uses_direct_decoder(SamplingParams(max_new_tokens=4, stop=("```",)))
    assert not HFEngine(model, tokenizer, HFEngineConfig(decoder="generate")).uses_direct_decoder(
        SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="decoder must be one of"):
        HFEngine(model, tokenizer, HFEngineConfig(decoder="fast"))


@pytest.mark.run
def test_greedy_tokens_and_logprobs_equal_generate(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer("What is 12 + 7?")["input_ids"], tokenizer("hi")["input_ids"]]  # different lengths
    params = SamplingParams(max_new_tokens=20, temperature=0.0, return_logprobs=True)
    direct, generate = (e.generate(prompts, n=2, params=params) for e in _engines(model, tokenizer).values())
    assert [g.token_ids for g in direct] == [g.token_ids for g in generate]
    assert [g.finish_reason for g in direct] == [g.finish_reason for g in generate]
    for a, b in zip(direct, generate):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


@pytest.mark.run
def test_log_probs_asked_for_only_where_free_come_from_the_direct_decoder_and_never_from_generate(
        model_and_tokenizer):
    """tokens.jsonl's ``logprobs_if_free``: the direct decoder computes the sampled tokens' log-probs
    anyway (the same as when asked outright); transformers' ``generate`` would keep a (B, V) copy per
    token for them, so it gives none. The rollout then records none, never zeros in their place."""
    from rlhf.runtime.rl.rollout import _Episode

    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer("What is 12 + 7?")["input_ids"]]
    free = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs_if_free=True)
    asked = SamplingParams(max_new_tokens=8, temperature=0.0, return_logprobs=True)
    engines = _engines(model, tokenizer)
    direct_free, direct_asked = (engines["direct"].generate(prompts, n=1, params=p)[0] for p in (free, asked))
    assert direct_free.logprobs is not None and direct_free.logprobs == direct_asked.logprobs
    assert engines["generate"].generate(prompts, n=1, params=free)[0].logprobs is None
    assert engines["generate"].generate(prompts, n=1, params=asked)[0].logprobs is not None

    sampled = {}
    for name, params in (("free", SamplingParams(max_new_tokens=8, temperature=0.8, logprobs_if_free=True)),
                         ("asked", SamplingParams(max_new_tokens=8, temperature=0.8, return_logprobs=True))):
        torch.manual_seed(3)
        sampled[name] = engines["direct"].generate(prompts, n=4, params=params)
    # sampled, asked only where free: log p of the sampled token from the sampling distribution,
    # not a log_softmax over the vocabulary per token; the same tokens, the same values to 1e-6
    for free_one, asked_one in zip(sampled["free"], sampled["asked"]):
        assert free_one.token_ids == asked_one.token_ids
        assert max(abs(a - b) for a, b in zip(free_one.logprobs, asked_one.logprobs)) <= 1e-5
        assert free_one.logprobs != [0.0] * len(free_one.logprobs)

    def episode(optional: bool) -> _Episode:
        return _Episode(item=None, group=0, env=None, label=None, tokens=[1, 2], mask=[0, 0], logprobs=[0.0, 0.0],
                        logprobs_optional=optional)

    unknown = episode(True)
    unknown.append([5, 6], model=True, logprobs=None)  # an engine that reports none for a free ask
    unknown.append([7], model=False)
    assert unknown.logprobs is None and unknown.tokens == [1, 2, 5, 6, 7]
    known = episode(True)
    known.append([5, 6], model=True, logprobs=[-0.5, -0.25])
    known.append([7], model=False)
    assert known.logprobs == [0.0, 0.0, -0.5, -0.25, 0.0]


def one_prefill_per_row(engine, rows, params):
    """The direct decoder with every row prefilled on its own (no prompt shared): (B, N) tokens, log-probs."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), engine.pad_id, dtype=torch.long)  # (B, P) left-padded
    attention_mask = torch.zeros_like(input_ids)  # (B, P)
    for row, ids in enumerate(rows):
        input_ids[row, width - len(ids):], attention_mask[row, width - len(ids):] = torch.tensor(ids), 1
    with torch.inference_mode():
        return engine._decode(input_ids, attention_mask, params)


@pytest.mark.run
def test_a_prompt_is_prefilled_once_for_all_the_rows_that_continue_it(model_and_tokenizer):
    """Rows that continue the same prompt share one prefill, its KV cache copied to each, whether
    they are the n samples of one prompt or the same prompt given again as rows of its own (as the
    rollout gives a group's trajectories), in any order: with the same random numbers they draw the
    tokens, and get the log-probs, that one prefill per row gets."""
    model, tokenizer = model_and_tokenizer
    a, b = tokenizer("What is 12 + 7?")["input_ids"], tokenizer("hi")["input_ids"]  # different lengths
    params = SamplingParams(max_new_tokens=12, temperature=0.9, return_logprobs=True)
    engine = HFEngine(model, tokenizer, HFEngineConfig(decoder="direct"))
    prefill_rows = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    try:
        for rows, n in (([a, b], 4), ([a, b, a, a, b, b, a, b], 1)):
            expected_rows = [p for p in rows for _ in range(n)]
            prefill_rows.clear()
            torch.manual_seed(3)
            shared = engine.generate(rows, n=n, params=params)
            assert prefill_rows[0][0] == 2  # the prefill: one row per distinct prompt
            torch.manual_seed(3)
            tokens, logprobs = one_prefill_per_row(engine, expected_rows, params)  # (B, N), (B, N)
            assert [g.token_ids for g in shared] == [row.tolist() for row in tokens]
            assert len({tuple(g.token_ids) for g in shared}) > 2  # sampled, not copies of one completion
            for generation, row in zip(shared, logprobs):
                assert torch.allclose(torch.tensor(generation.logprobs), row, atol=1e-5)
    finally:
        hook.remove()


@pytest.mark.run
def test_direct_decoder_samples_the_models_first_token_distribution(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = tokenizer("What is 12 + 7?")["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float() / 0.8, dim=-1)  # (V,)
    torch.manual_seed(1)
    draws = HFEngine(model, tokenizer).generate([prompt], n=20_000, params=SamplingParams(max_new_tokens=1,
                                                                                          temperature=0.8))
    first = torch.tensor([g.token_ids[0] for g in draws])
    freq = torch.bincount(first, minlength=probs.numel()).double() / first.numel()
    sigma = (probs.double() * (1 - probs.double()) / first.numel()).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-4).all()


@pytest.mark.run
@pytest.mark.parametrize("decoder", ["direct", "generate"])
def test_model_generation_config_does_not_change_the_sampled_distribution(model_and_tokenizer, decoder):
    """A checkpoint's repetition penalty, minimum length or top-k must not leak into rollouts: the
    engine's log-probs stay the trainer's."""
    import copy

    model, tokenizer = model_and_tokenizer
    saved = copy.deepcopy(model.generation_config)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.min_new_tokens = 6
    model.generation_config.top_k = 3
    try:
        torch.manual_seed(0)
        engine = HFEngine(model, tokenizer, HFEngineConfig(decoder=decoder))
        prompts = [tokenizer("What is 12 + 7?")["input_ids"]]
        generations = engine.generate(prompts, n=4, params=SamplingParams(max_new_tokens=6, return_logprobs=True))
    finally:
        model.generation_config = saved
    assert len(generations) == 4
    assert_engine_logprobs_are_the_trainers(model, tokenizer, prompts * 4, generations)


@pytest.mark.run
def test_stop_strings_still_cut_generations(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    prompt = tokenizer("What is 12 + 7?")["input_ids"]
    text = tokenizer.decode(engine.generate([prompt], n=1, params=greedy)[0].token_ids)
    assert len(text) >= 4, text
    stop = text[2:4]  # occurs in the greedy continuation, first at or before character 2
    (cut,) = engine.generate([prompt], n=1, params=SamplingParams(max_new_tokens=12, temperature=0.0, stop=(stop,)))
    assert cut.stop_string == stop and cut.finish_reason == "stop"
    assert stop in tokenizer.decode(cut.token_ids) and stop not in tokenizer.decode(cut.token_ids[:-1])
    assert len(tokenizer.decode(cut.token_ids)) <= len(text)


@pytest.mark.unit
def test_fused_adamw_steps_like_the_plain_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    reference = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    reference.load_state_dict(model.state_dict())
    initial = model[0].weight.detach().clone()
    config = BackendConfig(lr=1e-2, adam_betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.0)
    backend = TorchBackend(model, config)
    assert backend.optimizer.defaults["fused"] is True
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    inputs = torch.randn(16, 5)
    for _ in range(5):
        model(inputs).pow(2).mean().backward()
        backend.step()
        reference(inputs).pow(2).mean().backward()
        plain.step()
        plain.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not torch.equal(model[0].weight, initial), "the optimizer did not move the weights"


@pytest.mark.unit
def test_token_logprobs_at_unit_temperature_and_through_peft(model_and_tokenizer):
    from peft import LoraConfig, get_peft_model

    model, _ = model_and_tokenizer
    trajectories = [Trajectory(token_ids=[3, 4, 5, 6, 7], loss_mask=[0, 0, 0, 1, 1], prompt_length=3, prompt="",
                               prompt_text="", completion_text="", group=0),
                    Trajectory(token_ids=[3, 9, 10, 11], loss_mask=[0, 0, 1, 1], prompt_length=2, prompt="",
                               prompt_text="", completion_text="", group=0)]
    batch = collate(trajectories, pad_token_id=0, rewards=torch.zeros(2), sample_mask=torch.ones(2))
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, -1)
    expected = full[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # (B, A)
    mask = batch.action_mask.bool()

    import copy

    wrapped = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    shapes, inputs = [], []
    hook = wrapped.get_base_model().lm_head.register_forward_hook(lambda m, i, out: shapes.append(out.shape))
    run = wrapped.get_base_model().model.register_forward_hook(lambda m, i, out: inputs.append(out[0].shape[1]))
    try:
        for candidate in (model, wrapped):  # a fresh LoRA adapter is zero: the same function
            with torch.no_grad():
                logprobs, _ = token_logprobs(candidate, batch.input_ids, batch.attention_mask, batch.action_mask)
            torch.testing.assert_close(logprobs[mask], expected[mask], atol=1e-5, rtol=1e-5)
    finally:
        hook.remove()
        run.remove()
    # The last column only holds targets: the model runs 4 of the 5 tokens. The first action is token
    # 2 of row 2 (predicted at position 1): positions 1-3 need logits, also through the PEFT wrapper
    # (it passes logits_to_keep on to the model).
    assert inputs == [4]
    assert shapes == [torch.Size([2, 3, model.config.vocab_size])]
    assert math.isfinite(float(logprobs[mask].sum()))


@pytest.mark.unit
def test_without_last_token_unsets_each_rows_last_real_token_on_either_padding_side():
    from rlhf.core.logprobs import without_last_token
    from rlhf.fastpaths.prefix_sharing import share_prefixes

    mask = torch.tensor([[1, 1, 1, 0, 0],  # right-padded
                         [0, 0, 1, 1, 1],  # left-padded
                         [0, 0, 0, 0, 0],  # empty
                         [1, 0, 0, 0, 0]])  # one token
    assert without_last_token(mask).tolist() == [[1, 1, 0, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [0] * 5]
    assert mask.sum() == 7, "the mask given is left as it was"
    # two rows of one prompt laid out without their last tokens: prompt 2 + 1 + 2 instead of 2 + 2 + 3
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 10, 11]])
    rows = share_prefixes(ids, without_last_token(torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])), [[0, 1]])
    assert rows.input_ids.tolist() == [[5, 6, 7, 9, 10]]
