"""The decode's distributions written into one buffer (rlhf/plugins/engines/sampling.py, `DecodeSoftmax`):

* the values are ``torch.softmax``'s (``log``: ``torch.log_softmax``'s), bit for bit, with masked
  (-inf) entries and fewer rows;
* one buffer serves every call of a decode, a larger batch or another vocabulary gets a new one;
* both ``hf`` decoders (the batched one and the continuous batch) sample through it, every token of
  a decode in the same storage, and sample (and report the log-probs) what a fresh softmax and
  log-softmax a token give;
* what it is for: a decode at a large vocabulary under rlhf's 1 MiB mmap threshold no longer maps
  and page-faults a fresh (B, V) result a token (a process of its own: the threshold is global).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers import ROOT
from rlhf.core.protocols.rollout import SamplingParams
from rlhf.plugins.engines.config import HFEngineConfig
from rlhf.plugins.engines.hf import HFEngine
from rlhf.plugins.engines.sampling import DecodeSoftmax


@pytest.mark.unit
def test_the_values_are_torch_softmax_bit_for_bit():
    torch.manual_seed(0)
    softmax = DecodeSoftmax()
    scores = torch.randn(8, 5000) * 4  # (B, V)
    scores[1, 100:] = float("-inf")  # a row cut by top-k
    scores[2] += 1e4  # large logits: the max is taken out first
    assert torch.equal(softmax(scores), torch.softmax(scores, dim=-1))
    fewer = torch.randn(3, 5000)
    assert torch.equal(softmax(fewer), torch.softmax(fewer, dim=-1))
    assert float(softmax(scores)[1, 100:].abs().sum()) == 0.0
    log_softmax = DecodeSoftmax(log=True)
    assert torch.equal(log_softmax(scores), torch.log_softmax(scores, dim=-1))
    assert torch.equal(log_softmax(fewer), torch.log_softmax(fewer, dim=-1))


@pytest.mark.unit
def test_one_buffer_serves_the_decode_and_a_larger_batch_gets_another():
    softmax = DecodeSoftmax()
    first = softmax(torch.randn(4, 300))
    storage = first.data_ptr()
    second = softmax(torch.randn(4, 300))
    assert second.data_ptr() == storage  # written again in place
    assert softmax(torch.randn(2, 300)).data_ptr() == storage  # fewer rows: the buffer's first rows
    assert softmax(torch.randn(6, 300)).data_ptr() != storage  # more rows than it holds: a new one
    assert softmax.buffer.shape == (6, 300)  # held from now on
    assert softmax(torch.randn(6, 301)).shape == (6, 301)  # another vocabulary
    assert softmax(torch.randn(6, 301, dtype=torch.float64)).dtype == torch.float64
    transposed = torch.randn(301, 7).t()  # (7, 301) scores laid out column-major
    probs = DecodeSoftmax()(transposed)
    assert probs.is_contiguous() and torch.equal(probs, torch.softmax(transposed, dim=-1))


def _spy(monkeypatch, log=False):
    """Every distribution (``log``: log-distribution) a decode computed, kept alive (so a fresh
    allocation cannot take the address of a freed one), with whether it equalled a fresh one when
    it was computed."""
    seen = []
    call = DecodeSoftmax.__call__

    def spy(self, scores):
        probs = call(self, scores)
        if (self.function is torch.log_softmax) == log:
            seen.append((probs, torch.equal(probs, self.function(scores, dim=-1))))
        return probs

    monkeypatch.setattr(DecodeSoftmax, "__call__", spy)
    return seen


def _fresh(self, scores):
    return self.function(scores, dim=-1)


@pytest.mark.run
@pytest.mark.parametrize(("decoder", "log"), [("lean", False), ("direct", False), ("lean", True)])
def test_the_batched_decoder_samples_every_token_from_one_buffer(tiny_model_dir, monkeypatch, decoder, log):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer,
                      HFEngineConfig(decoder=decoder))
    engine.eos_ids = {10 ** 6}  # every row runs to its budget
    prompts = [tokenizer("What is 12 + 7?")["input_ids"], tokenizer("hi")["input_ids"]]
    # return_logprobs: a loss reads the engine's log-probs, taken from a log-softmax a token
    params = SamplingParams(max_new_tokens=9, temperature=0.8, return_logprobs=log)
    engine.generate(prompts, n=3, params=params)  # the lean variant's first-use check, outside the spy
    seen = _spy(monkeypatch, log=log)
    torch.manual_seed(5)
    generations = engine.generate(prompts, n=3, params=params)
    assert len(seen) == params.max_new_tokens
    assert len({probs.data_ptr() for probs, _ in seen}) == 1 and all(equal for _, equal in seen)
    monkeypatch.setattr(DecodeSoftmax, "__call__", _fresh)
    torch.manual_seed(5)
    fresh = engine.generate(prompts, n=3, params=params)
    assert [g.token_ids for g in fresh] == [g.token_ids for g in generations]
    assert [g.logprobs for g in fresh] == [g.logprobs for g in generations]


@pytest.mark.run
def test_the_continuous_batch_samples_from_one_buffer(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer, HFEngineConfig())
    engine.eos_ids = {10 ** 6}
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 12 + 7?", "hi", "Say many a's")]
    params = [SamplingParams(max_new_tokens=6, temperature=0.9, seed=11 + i) for i in range(len(prompts))]

    async def decode():
        return await asyncio.gather(*(engine.generate_one(p, q) for p, q in zip(prompts, params)))

    seen, logs = _spy(monkeypatch), []
    call = DecodeSoftmax.__call__
    monkeypatch.setattr(DecodeSoftmax, "__call__", lambda self, scores: logs.append(self.function) or call(self, scores))
    first = asyncio.run(decode())
    assert len(seen) >= params[0].max_new_tokens and logs.count(torch.log_softmax) == len(seen)
    assert len({probs.data_ptr() for probs, _ in seen}) == 1
    assert all(equal for _, equal in seen)  # each call's own rows, not what another step left
    monkeypatch.setattr(DecodeSoftmax, "__call__", _fresh)
    again = asyncio.run(decode())  # seeded requests: the same draws, the same log-probs
    assert [g.token_ids for g in again] == [g.token_ids for g in first]
    assert [g.logprobs for g in again] == [g.logprobs for g in first]


FAULTS = textwrap.dedent("""
    import json, resource, sys
    import torch
    from torch import nn
    from rlhf.core.protocols.rollout import SamplingParams
    from rlhf.runtime.run.heap import MMAP_THRESHOLD, return_freed_blocks
    from rlhf.plugins.engines.hf import HFEngine
    from rlhf.plugins.engines.config import HFEngineConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert return_freed_blocks(MMAP_THRESHOLD)  # what a run on a large model sets
    torch.set_num_threads(1)
    directory, block_head = sys.argv[1], sys.argv[2] == "1"
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    vocab = 1 << 16  # (B, V) float32 over 16 rows: 4 MiB a token, mapped when fresh
    model.resize_token_embeddings(vocab)
    model.lm_head = nn.Linear(model.config.hidden_size, vocab, bias=False)  # 4.2M elements: blocks pay
    engine = HFEngine(model, tokenizer, HFEngineConfig(decoder="lean", block_head=block_head))
    engine.eos_ids = {10 ** 6}
    prompts = [tokenizer("hi")["input_ids"], tokenizer("What is 12 + 7?")["input_ids"]]
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    engine.generate(prompts, n=8, params=params)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.generate(prompts, n=8, params=params)
    print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
""")


@pytest.mark.run
@pytest.mark.parametrize("block_head", [True, False])
def test_a_decode_at_a_large_vocabulary_maps_no_fresh_distribution_a_token(tiny_model_dir, block_head):
    out = subprocess.run([sys.executable, "-c", FAULTS, str(tiny_model_dir), "1" if block_head else "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    faults = json.loads(out.stdout.strip().splitlines()[-1])
    fresh_per_token = 16 * (1 << 16) * 4 // 4096  # pages of one (B, V) float32 tensor
    # a fresh softmax a token alone would fault 24 x 1,024 pages; the layer's own product (no blocks)
    # still maps its logits a token, the blocked head writes them into its held buffer
    bound = (1.5 if not block_head else 0.5) * 24 * fresh_per_token
    assert faults < bound, f"{faults} page faults over 24 tokens"
