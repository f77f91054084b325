"""The CPU equivalence tests' comparisons on a CUDA GPU, in float32 and bfloat16, at sizes where
the GPU paths differ from the CPU's (several chunks, attention per segment that pays):

* packed log-probs, entropy and gradients equal the padded forward's (sdpa attends within each
  sequence through the mask transformers builds from the packed position ids);
* a prompt's samples laid out as one shared row equal the separate forwards, both through the
  attention per segment (rlhf/fastpaths/segment_attention.py) and through the model's forward under
  the row's mask;
* the log-prob softmax in chunks (`token_logprobs`: 8 rows at a time; packed and shared rows:
  2048 positions at a time) equals one ``log_softmax`` over all the logits at once, values,
  entropy and gradients.

The ``cuda`` cases are marked ``gpu`` (skipped without CUDA; ``bash tools/gpu_check.sh --device``
runs them on the lent GPU and reports the differences each records with ``record_property``). The
``cpu`` cases run the same code in CI at smaller sizes, with the chunk sizes shrunk so that
several chunks still run.

Tolerances. float32: 1e-4 on log-probs (values near -8 for a 4096-token vocabulary; the GPU's
kernels sum in other orders than the CPU's). bfloat16 keeps 8 significant bits: the two sides run
forwards of different shapes (packed, shared, fewer columns), so each token's log-prob carries its
own rounding; the largest difference must stay under 5e-2 nats (the bound rlhf itself applies when
it checks a model's shared forward) and the mean under 1e-2. Gradients: the relative difference
of each parameter's gradient, at most 1e-3 in float32 and 0.1 in bfloat16 (measured on a CPU: 1e-2;
a wrong mask or position moves it by order 1).
"""

from __future__ import annotations

import pytest
import torch

import rlhf.core.logprobs as logprobs_module
import rlhf.fastpaths.prefix_sharing as sharing
import rlhf.fastpaths.segment_attention as segments
from rlhf.core.logprobs import token_logprobs
from rlhf.fastpaths.prefix_sharing import shared_token_logprobs
from rlhf.fastpaths.packing import PackedModel
from rlhf.fastpaths.prefix_sharing import share_prefixes

pytestmark = pytest.mark.unit

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"]
DTYPES = ["float32", "bfloat16"]
TOLERANCE = {  # max |Δ log-prob|, mean |Δ log-prob|, max relative gradient difference
    "float32": (1e-4, 1e-5, 1e-3),
    "bfloat16": (5e-2, 1e-2, 1e-1),
}
VOCAB = 4096


def llama(device: str, dtype: str, *, hidden: int, layers: int):
    """A random-weight Llama with grouped key-value heads and sdpa attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype))


def sizes(device: str) -> dict[str, int]:
    if device == "cuda":  # the chunk sizes as shipped: 32 rows = 4 row chunks, ~2,700 positions = 2 position chunks
        return dict(hidden=256, layers=4, rows=32, length=128, prompt=96, samples=8, completion=96)
    return dict(hidden=64, layers=2, rows=10, length=24, prompt=16, samples=4, completion=12)


@pytest.fixture
def small_chunks_on_cpu(request, monkeypatch):
    """On a CPU the batches are small: shrink the chunks so that several of each still run."""
    if request.node.callspec.params["device"] == "cpu":
        monkeypatch.setattr(logprobs_module, "_ROWS_PER_CHUNK", 3)
        monkeypatch.setattr(logprobs_module, "_POSITIONS_PER_CHUNK", 32)


def padded_rows(rows: int, length: int, device: str, seed: int = 0):
    """(B, T) ids and mask, rows of 40-100 % of ``length`` padded left, right or both; actions (B, T - 1)
    on every real token after the fourth."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    mask = torch.zeros(rows, length, dtype=torch.long)
    actions = torch.zeros(rows, length - 1)
    for row in range(rows):
        real = int(length * (0.4 + 0.6 * torch.rand((), generator=generator)))
        start = [0, length - real, (length - real) // 2][row % 3]  # right-, left-, both-side padded
        mask[row, start:start + real] = 1
        actions[row, start + 3:start + real - 1] = 1
    return (ids * mask).to(device), mask.to(device), actions.to(device)


def grouped_rows(groups: int, samples: int, prompt: int, completion: int, device: str, seed: int = 0):
    """``groups`` prompts x ``samples`` completions each, prompts left-padded and completions
    right-padded (how rlhf lays out a rollout); actions on the completions."""
    generator = torch.Generator().manual_seed(seed)
    length = prompt + completion
    ids = torch.zeros(groups * samples, length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    actions = torch.zeros(groups * samples, length - 1)
    for g in range(groups):
        p = int(prompt * (0.5 + 0.5 * torch.rand((), generator=generator)))
        tokens = torch.randint(3, VOCAB, (p,), generator=generator)
        for s in range(samples):
            row, c = g * samples + s, int(completion * (0.3 + 0.7 * torch.rand((), generator=generator)))
            ids[row, prompt - p:prompt] = tokens
            ids[row, prompt:prompt + c] = torch.randint(3, VOCAB, (c,), generator=generator)
            mask[row, prompt - p:prompt + c] = 1
            actions[row, prompt - 1:prompt + c - 1] = 1  # the positions predicting the completion
    return ids.to(device), mask.to(device), actions.to(device), [list(range(g * samples, (g + 1) * samples))
                                                                  for g in range(groups)]


def forward_and_grads(model, forward, actions):
    """(log-probs, entropy) of ``forward()`` masked by ``actions``, and every parameter's gradient of
    their sum (entropy weighted 0.1), in float32."""
    model.zero_grad()
    logprobs, entropy = forward()
    ((logprobs + 0.1 * entropy) * actions).sum().backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return (logprobs * actions).detach().float(), (entropy * actions).detach().float(), grads


def assert_equal_within(dtype, got, expected, actions, record_property, what):
    """Compare two (values, entropy, grads) triples; record the largest differences."""
    max_tol, mean_tol, grad_tol = TOLERANCE[dtype]
    real = actions.bool()
    assert (expected[0][real] < 0).all(), "compared values must be real log-probs"
    worst_grad = 0.0
    for name, grad in expected[2].items():
        scale = float(grad.norm())
        if scale > 0:
            worst_grad = max(worst_grad, float((got[2][name] - grad).norm()) / scale)
    assert got[2].keys() == expected[2].keys()
    for label, a, b in (("logprob", got[0], expected[0]), ("entropy", got[1], expected[1])):
        difference = (a - b).abs()[real]
        record_property(f"{what} max |d {label}|", f"{float(difference.max()):.3g}")
        record_property(f"{what} mean |d {label}|", f"{float(difference.mean()):.3g}")
        assert float(difference.max()) <= max_tol, (label, float(difference.max()))
        assert float(difference.mean()) <= mean_tol, (label, float(difference.mean()))
    record_property(f"{what} max grad rel diff", f"{worst_grad:.3g}")
    assert worst_grad <= grad_tol, worst_grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_packed_logprobs_and_gradients_equal_the_padded_ones(device, dtype, record_property, small_chunks_on_cpu):
    size = sizes(device)
    model = llama(device, dtype, hidden=size["hidden"], layers=size["layers"])
    ids, mask, actions = padded_rows(size["rows"], size["length"], device)
    padded = forward_and_grads(model, lambda: token_logprobs(model, ids, mask, actions, with_entropy=True), actions)
    packed = forward_and_grads(model, lambda: token_logprobs(PackedModel(model), ids, mask, actions, with_entropy=True),
                               actions)
    assert_equal_within(dtype, packed, padded, actions, record_property, "packed")


@pytest.mark.parametrize("path", ["segments", "masked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_shared_rows_equal_separate_forwards(device, dtype, path, record_property, monkeypatch, small_chunks_on_cpu):
    size = sizes(device)
    model = llama(device, dtype, hidden=size["hidden"], layers=size["layers"])
    ids, mask, actions, groups = grouped_rows(3, size["samples"], size["prompt"], size["completion"], device)
    rows = share_prefixes(ids, mask, groups)
    # "segments": attention per segment whatever it saves; "masked": the model's forward under the mask
    monkeypatch.setattr(segments, "SEGMENTS_PAY_FROM", 0 if path == "segments" else 1 << 62)
    calls = []
    per_segment = segments.shared_forward_hidden
    monkeypatch.setattr(sharing, "shared_forward_hidden", lambda *a: calls.append(1) or per_segment(*a))
    separate = forward_and_grads(model, lambda: token_logprobs(model, ids, mask, actions, with_entropy=True), actions)
    shared = forward_and_grads(model, lambda: shared_token_logprobs(model, rows, ids, actions, with_entropy=True),
                               actions)
    assert bool(calls) == (path == "segments"), "the shared forward took the other path"
    assert_equal_within(dtype, shared, separate, actions, record_property, path)


def full_softmax_logprobs(model, ids, mask):
    """log softmax over every position's logits at once, (B, T - 1) log-probs and entropy: the
    unchunked definition the chunked functions must reproduce."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()  # (B, T - 1, V)
    log_p = torch.log_softmax(logits, dim=-1)  # (B, T - 1, V)
    logprobs = log_p.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T - 1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)  # (B, T - 1)
    return logprobs, entropy


@pytest.mark.parametrize("layout", ["rows", "packed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_chunked_logprobs_equal_one_full_softmax(device, dtype, layout, record_property, small_chunks_on_cpu):
    size = sizes(device)
    model = llama(device, dtype, hidden=size["hidden"], layers=size["layers"])
    ids, mask, actions = padded_rows(size["rows"], size["length"], device, seed=1)
    chunk = logprobs_module._ROWS_PER_CHUNK if layout == "rows" else logprobs_module._POSITIONS_PER_CHUNK
    units = ids.shape[0] if layout == "rows" else int(actions.sum())
    assert units > chunk, f"{units} {layout} fit one chunk of {chunk}: the test would check no chunking"
    lm = model if layout == "rows" else PackedModel(model)
    chunked = forward_and_grads(model, lambda: token_logprobs(lm, ids, mask, actions, with_entropy=True), actions)
    full = forward_and_grads(model, lambda: full_softmax_logprobs(model, ids, mask), actions)
    assert_equal_within(dtype, chunked, full, actions, record_property, f"{layout} chunks")
