"""Fast-path verdicts (rlhf/fastpaths/verdicts.py) meet non-finite differences: a NaN or an infinite
difference between a fast path and the plain one is a disagreement, in `settle` itself and in
every caller that measures one (prefix sharing, packing, oneDNN linears, vocabulary chunks, the
lean decode step): a fast path whose output turned NaN or inf is not taken, the plain path runs,
and one warning names the switch."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from rlhf.fastpaths.verdicts import settle, verdict

pytestmark = pytest.mark.run  # the callers' checks run the tiny model

NON_FINITE = [math.nan, math.inf, -math.inf]


class Model:
    """Anything with a ``__dict__`` holds verdicts."""


@pytest.mark.parametrize("difference", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_a_non_finite_difference_never_agrees(difference, caplog):
    model = Model()
    with caplog.at_level(logging.WARNING):
        assert settle(model, "some/path", difference, 1e-3, who="test", switch="--no-some-path") is False
    assert verdict(model, "some/path") is False
    assert "the fast path some/path differs from the plain path" in caplog.text and "--no-some-path" in caplog.text


def test_a_finite_difference_agrees_up_to_the_tolerance_and_each_path_is_its_own(caplog):
    model, other = Model(), Model()
    assert verdict(model, "a") is None
    with caplog.at_level(logging.WARNING):
        assert settle(model, "a", 0.0, 1e-3, who="t", switch="s") is True
        assert settle(model, "b", 1e-3, 1e-3, who="t", switch="s") is True  # the tolerance itself agrees
    assert caplog.text == ""  # agreement is silent
    assert settle(model, "c", 1.0000001e-3, 1e-3, who="t", switch="s") is False
    assert (verdict(model, "a"), verdict(model, "b"), verdict(model, "c"), verdict(other, "a")) == (True, True, False,
                                                                                                   None)


# --- every caller with a fast path whose output is not finite ------------------------------------------


BAD = {"nan": math.nan, "inf": math.inf}


@pytest.fixture(params=list(BAD))
def bad(request):
    return BAD[request.param]


def lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")


def batch():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    actions = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.float32)
    return ids, mask, actions


def test_prefix_sharing_whose_shared_logprobs_are_not_finite_runs_separately(bad):
    from rlhf.fastpaths.prefix_sharing import checked_for_sharing, share_prefixes

    model = nn.Linear(2, 2)
    model.config = type("Config", (), {"_attn_implementation": "sdpa"})()
    ids, mask, _ = batch()
    rows = share_prefixes(ids, mask, [[0], [1]])
    separate = torch.zeros(2, 5)
    shared = separate.clone()
    shared[1, 3] = bad
    assert checked_for_sharing(model, rows, lambda: shared, lambda: separate, who="test") is False
    assert checked_for_sharing(model, rows, lambda: separate, lambda: separate, who="test") is False  # kept


def test_packing_whose_packed_logprobs_are_not_finite_runs_padded(tiny_model_dir, bad, monkeypatch):
    import rlhf.fastpaths.packing as packing
    from rlhf.core.logprobs import token_logprobs

    model = lm(tiny_model_dir)
    ids, mask, actions = batch()
    padded, _ = token_logprobs(model, ids, mask, actions)
    real = packing._packed_logprobs

    def broken(*args, **kwargs):
        logprobs, entropy = real(*args, **kwargs)
        logprobs = logprobs.clone()
        logprobs[0, 3] = bad  # an action position
        return logprobs, entropy

    monkeypatch.setattr(packing, "_packed_logprobs", broken)
    got, _ = token_logprobs(packing.PackedModel(model), ids, mask, actions)
    assert verdict(model, packing.packing_path(model, ids, mask)) is False and torch.equal(got, padded)


def test_a_onednn_linear_whose_product_is_not_finite_goes_back_to_nn_linear(bad, monkeypatch):
    from rlhf.fastpaths import cpu_linear

    if not cpu_linear.onednn_available():
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    plain = nn.Linear(128, 256)
    fast = copy.deepcopy(plain)
    assert cpu_linear.use_onednn_linears(fast, "onednn") == 1 and type(fast) is cpu_linear.OneDnnLinear
    real = cpu_linear.onednn_product

    def broken(*args):
        out = real(*args).clone()
        out.view(-1)[0] = bad
        return out

    monkeypatch.setattr(cpu_linear, "onednn_product", broken)
    x = torch.randn(64, 128)  # enough multiply-adds for oneDNN
    assert torch.equal(fast(x), plain(x))
    assert type(fast) is nn.Linear and verdict(fast, "cpu_linear") is False


def test_vocab_chunks_whose_logprobs_are_not_finite_run_the_plain_head(tiny_model_dir, bad, monkeypatch):
    from rlhf.core.logprobs import token_logprobs
    from rlhf.fastpaths import vocab_chunks

    model = lm(tiny_model_dir)
    expected_model = copy.deepcopy(model)
    vocab_chunks.use_vocab_chunks(model)
    monkeypatch.setattr(vocab_chunks, "FULL_LOGITS_UP_TO", 0)  # tiles, however small the batch
    real = vocab_chunks._ChunkedLogprobs.apply

    def broken(*args):
        logprobs, entropy = real(*args)
        return logprobs.clone().fill_(bad) if logprobs.numel() else logprobs, entropy

    monkeypatch.setattr(vocab_chunks._ChunkedLogprobs, "apply", broken)
    ids, mask, actions = batch()
    got, _ = token_logprobs(model, ids, mask, actions)
    expected, _ = token_logprobs(expected_model, ids, mask, actions)
    assert verdict(model.lm_head, "vocab_chunks") is False
    assert torch.isfinite(got).all() and torch.allclose(got, expected, atol=1e-5)


def test_a_lean_decode_step_that_is_not_finite_is_caught_and_the_forward_runs(tiny_model_dir, bad, monkeypatch):
    from transformers import AutoTokenizer

    from rlhf.core.protocols.rollout import SamplingParams
    from rlhf.fastpaths.lean_decode import LeanDecoder
    from rlhf.plugins.engines.hf import HFEngine, HFEngineConfig

    model, tokenizer = lm(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [[40, 41, 42, 43], [50, 51]]
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    expected = HFEngine(model, tokenizer, HFEngineConfig(decoder="direct")).generate(prompts, n=2, params=params)
    real = LeanDecoder.step

    def broken(self, tokens, positions):
        logits = real(self, tokens, positions).clone()
        logits[0, 0] = bad
        return logits

    monkeypatch.setattr(LeanDecoder, "step", broken)
    got = HFEngine(model, tokenizer).generate(prompts, n=2, params=params)
    assert [verdict(model, path) for path in ("lean_decode/padded/grouped",)] == [False]
    assert [g.token_ids for g in got] == [g.token_ids for g in expected]
