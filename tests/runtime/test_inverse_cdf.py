"""The CPU sampler draws each token with its probability, in one level or two (rlhf/plugins/engines/sampling.py).

Checked against an exact reference (float64 cumulative sums over the whole row, the uniform
scaled in float64), on rows with zeros at block edges, whole empty blocks and a short last block,
and at the one place the two levels can disagree with the reference: a block whose float32 sum is
rounded above its entries' exact sum.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.plugins.engines import sampling
from rlhf.plugins.engines.sampling import BLOCK, TWO_LEVEL_FROM, inverse_cdf, sample_categorical


def exact_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first v with Σ_{i ≤ v} p_i > u·total, every sum in float64: the sampler's definition."""
    cdf = probs.double().cumsum(dim=-1)  # (B, V)
    u = uniforms.double() * cdf[:, -1:]  # (B, 1)
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def peaked_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Softmax rows with a long tail, like a language model's: most mass on a few hundred tokens."""
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=generator) * 4.0, dim=-1)  # (B, V)


@pytest.mark.unit
@pytest.mark.parametrize("vocab", [TWO_LEVEL_FROM, 32_000, 151_936])
def test_two_levels_draw_what_the_exact_cumulative_sum_draws(vocab):
    assert vocab >= TWO_LEVEL_FROM
    probs = peaked_rows(16, vocab, seed=vocab)
    generator = torch.Generator().manual_seed(1)
    differ = 0
    for _ in range(40):
        uniforms = torch.rand((16, 1), generator=generator)  # (B, 1) float32, as the engine draws
        drawn = inverse_cdf(probs, uniforms)
        differ += int((drawn != exact_inverse_cdf(probs, uniforms)).sum())
        assert bool((probs.gather(1, drawn[:, None]) > 0).all())
    # a disagreement needs u·total within float32 rounding of a block's sum: none in 640 draws
    assert differ == 0


@pytest.mark.unit
def test_both_levels_follow_the_probabilities_and_never_draw_a_zero():
    vocab = 3 * BLOCK + 100  # a short last block
    probs = torch.zeros(vocab)
    mass = {0: 0.1, BLOCK - 1: 0.2, BLOCK: 0.05, 2 * BLOCK + 7: 0.3, vocab - 2: 0.25, vocab - 101: 0.1}
    for token, p in mass.items():
        probs[token] = p  # block 1 holds only its first entry; zeros before, between and after
    torch.manual_seed(0)
    for two_levels in (True, False):
        draws = 100_000
        rows = probs.expand(draws, -1)
        if two_levels:
            drawn = sampling._two_level(rows, torch.rand(draws, 1))
        else:
            drawn = sample_categorical(rows)
        counts = torch.bincount(drawn, minlength=vocab).double() / draws
        assert counts[probs == 0].sum() == 0
        sigma = (probs.double() * (1 - probs.double()) / draws).sqrt()
        assert ((counts - probs.double()).abs() <= 5 * sigma + 1e-12).all()


@pytest.mark.unit
def test_uniforms_at_the_ends_of_blocks_land_on_a_drawable_token():
    vocab = TWO_LEVEL_FROM + 5
    probs = torch.zeros(2, vocab)
    probs[:, 3] = 0.5  # block 0 ends with zeros
    probs[:, 2 * BLOCK] = 0.25  # block 1 empty; block 2 starts with its mass
    probs[:, vocab - 1] = 0.25  # the very last entry
    probs[1] *= 4.0  # a row that does not sum to one
    for u, expected in {0.0: 3, 0.4999999: 3, 0.5: 2 * BLOCK, 0.7499999: 2 * BLOCK, 0.75: vocab - 1,
                        1.0 - 2.0 ** -24: vocab - 1}.items():
        uniforms = torch.full((2, 1), u)
        assert inverse_cdf(probs, uniforms).tolist() == [expected, expected], u
        assert exact_inverse_cdf(probs, uniforms).tolist() == [expected, expected], u


@pytest.mark.unit
def test_a_block_sum_rounded_up_sends_its_sliver_to_the_blocks_last_drawable_token():
    vocab = TWO_LEVEL_FROM
    probs = torch.zeros(1, vocab)
    probs[0, 0], probs[0, 1] = 1.0, 1.5 * 2.0 ** -24  # float32 sum 1 + 2⁻²³: half an ulp above the exact sum
    probs[0, BLOCK] = 1.0
    exact_first_block = 1.0 + 1.5 * 2.0 ** -24
    assert float(probs[0, :BLOCK].sum()) > exact_first_block
    total = float(probs[0, :BLOCK].sum()) + 1.0
    sliver = torch.tensor([[(exact_first_block + 0.25 * 2.0 ** -24) / total]], dtype=torch.float64)
    assert inverse_cdf(probs, sliver).tolist() == [1]  # not past the block, and not a zero
    inside = torch.tensor([[(1.0 + 0.5 * 2.0 ** -24) / total]], dtype=torch.float64)  # token 1's own interval
    assert inverse_cdf(probs, inside).tolist() == exact_inverse_cdf(probs, inside).tolist() == [1]
    assert inverse_cdf(probs, torch.tensor([[0.25]])).tolist() == [0]
    assert inverse_cdf(probs, torch.tensor([[0.75]])).tolist() == [BLOCK]


@pytest.mark.unit
def test_small_vocabularies_keep_the_single_cumulative_sum():
    probs = peaked_rows(8, TWO_LEVEL_FROM - 1, seed=3)
    uniforms = torch.rand(8, 1)
    cdf = probs.cumsum(dim=-1)  # the one-level way, float32 values
    expected = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(1)
    assert torch.equal(inverse_cdf(probs, uniforms), expected)
    unnormalised = torch.tensor([[1.0, 0.0, 3.0], [0.5, 0.5, 0.0]])  # totals 4 and 1: u x total, not u / total
    assert inverse_cdf(unnormalised, torch.tensor([[0.5], [0.75]])).tolist() == [2, 1]
    assert inverse_cdf(unnormalised, torch.tensor([[0.2], [0.25]])).tolist() == [0, 0]


@pytest.mark.run
def test_the_engine_samples_a_large_vocabulary_in_two_levels(monkeypatch, tiny_model_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf.core.protocols.rollout import SamplingParams
    from rlhf.plugins.engines.hf import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    vocab = TWO_LEVEL_FROM + 100
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, eos_token_id=vocab - 1)).eval()
    shapes = []
    two_level = sampling._two_level
    monkeypatch.setattr(sampling, "_two_level", lambda probs, uniforms: shapes.append(tuple(probs.shape)) or
                        two_level(probs, uniforms))
    prompts = [tokenizer("a b c")["input_ids"], tokenizer("d e")["input_ids"]]
    outputs = HFEngine(model, tokenizer).generate(prompts, n=2, params=SamplingParams(max_new_tokens=5, temperature=1.0))
    assert len(outputs) == 4 and all(0 < len(out.token_ids) <= 5 for out in outputs)
    assert all(0 <= token < vocab for out in outputs for token in out.token_ids)
    assert shapes and set(shapes) == {(4, vocab)}
