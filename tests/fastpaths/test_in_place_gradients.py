"""The embedding's and the tiled output layer's weight gradients added into ``.grad`` in a backend's
backward (rlhf/fastpaths/in_place_gradients.py, on unless ``--no-in-place-gradients``):

* tied and untied weights, over three micro-batches: the gradients equal autograd's (an untied
  embedding's bit for bit), and after the first backward no (vocabulary x hidden) tensor is made
  and autograd is handed no gradient for those weights;
* outside a backend's backward (a user's own ``loss.backward()``) nothing changes, bit for bit;
* padding rows take no gradient; repeated tokens sum; a first backward whose in-place sum differs
  is caught: that model hands autograd its gradients from then on;
* the adapter gives the policy the ability, ``--no-in-place-gradients`` does not, the torch
  backend's backward takes it, and two CLI runs with and without it train to the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf.core.logprobs import token_logprobs
from rlhf.fastpaths import in_place_gradients, vocab_chunks
from rlhf.fastpaths.in_place_gradients import accumulating_in_place, use_in_place_gradients
from rlhf.fastpaths.verdicts import verdict
from tests.helpers import padded_batch, read_jsonl, run_cli


@pytest.fixture(autouse=True)
def always_tiles(monkeypatch):
    """Tiles for every call here, a few positions each (by default small logits are taken whole)."""
    monkeypatch.setattr(vocab_chunks, "FULL_LOGITS_UP_TO", 0)
    monkeypatch.setattr(vocab_chunks, "TILE_POSITIONS", 5)
    monkeypatch.setattr(vocab_chunks, "MIN_BLOCK", 1)
    monkeypatch.setattr(vocab_chunks, "TILE_ELEMENTS", 5 * 64)


def model(tmp_path, tied: bool):
    from transformers import AutoModelForCausalLM

    from rlhf.plugin_kit.tiny_model import build_random_model

    directory = build_random_model(tmp_path / ("tied" if tied else "untied"), tied=tied)
    lm = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    assert (lm.lm_head.weight is lm.model.embed_tokens.weight) is tied
    return lm


def tiled_pair(lm):
    """(a copy of ``lm``, both with tiled log-probs, ``lm`` also with in-place gradients; a list that
    grows by one each time autograd is handed ``lm``'s output-layer gradient)."""
    plain = copy.deepcopy(lm)
    vocab_chunks.use_vocab_chunks(lm), vocab_chunks.use_vocab_chunks(plain)
    use_in_place_gradients(lm)
    handed = []
    lm.lm_head.weight.register_hook(lambda grad: handed.append(1) if grad is not None else None)
    return plain, handed


class VocabularySized(TorchDispatchMode):
    """Counts the new tensors of ``shape`` that ops return (the (V, H) gradients)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()]
                 if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == self.shape
                    and tensor.untyped_storage().data_ptr() not in given):  # made here, not written in place
                self.count += 1
        return out


def micro_batches():
    ids, mask, actions = padded_batch()
    return [(ids.roll(shift, dims=1) * mask, mask, actions) for shift in range(3)]


def backward_all(lm, *, in_place: bool, hooks: list | None = None, counted: list | None = None):
    """Three micro-batches' backwards into the model's .grad, the torch backend's way (in place) or a
    user's plain ``loss.backward()``; returns {name: gradient}."""
    lm.zero_grad(set_to_none=True)
    params = list(lm.parameters())
    for index, (ids, mask, actions) in enumerate(micro_batches()):
        logprobs, _ = token_logprobs(lm, ids, mask, actions)  # (B, A)
        weights = torch.randn(actions.shape, generator=torch.Generator().manual_seed(index))  # (B, A)
        loss = (logprobs * weights * actions).sum()
        mode = VocabularySized(lm.lm_head.weight.shape)
        with accumulating_in_place(params) if in_place else torch.enable_grad(), mode:
            loss.backward()
        if counted is not None:
            counted.append(mode.count)
    return {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.unit
@pytest.mark.parametrize("tied", [True, False])
def test_gradients_in_place_equal_autograds_with_no_vocabulary_sized_temporary(tmp_path, tied):
    lm = model(tmp_path, tied)
    plain = copy.deepcopy(lm)
    assert vocab_chunks.use_vocab_chunks(lm) and vocab_chunks.use_vocab_chunks(plain)
    assert use_in_place_gradients(lm) == ["embedding", "head"]
    handed = []
    for weight in {id(w): w for w in (lm.model.embed_tokens.weight, lm.lm_head.weight)}.values():
        weight.register_hook(lambda grad: handed.append(1) if grad is not None else None)
    expected_counts, counts = [], []
    expected = backward_all(plain, in_place=False, counted=expected_counts)
    got = backward_all(lm, in_place=True, counted=counts)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        if tied or "lm_head" in name:  # the tiles' sum and, tied, the two parts added one after the other
            assert torch.allclose(got[name], grad, rtol=1e-5, atol=1e-7 * float(grad.abs().max())), name
        else:  # an untied embedding's rows are added as autograd adds its dense gradient
            assert torch.equal(got[name], grad), name
    assert float(expected["model.embed_tokens.weight"].abs().max()) > 1e-3  # real gradients were compared
    # autograd made (V, H) gradients in every backward (the tiles' sum, the embedding's dense one,
    # their sum tied); in place only the first backward makes them, to compare the two ways
    assert all(count >= 2 for count in expected_counts)
    assert counts[0] >= 2 and counts[1:] == [0, 0]
    assert verdict(lm.lm_head, "in_place_gradients/head") is True
    assert verdict(lm.model.embed_tokens, "in_place_gradients/embedding") is True
    assert handed == []  # autograd was never handed a gradient of these weights


@pytest.mark.unit
def test_a_first_check_beside_an_existing_grad_hands_the_plain_sum_over_and_leaves_grad_alone(tmp_path):
    lm = model(tmp_path, tied=False)
    plain, handed = tiled_pair(lm)
    ids, mask, actions = micro_batches()[0]
    for model_, in_place in ((lm, True), (plain, False)):
        model_.lm_head.weight.grad = torch.full_like(model_.lm_head.weight, 0.5)  # an earlier backward's
        loss = token_logprobs(model_, ids, mask, actions)[0].sum()
        with accumulating_in_place(model_.parameters()) if in_place else torch.enable_grad():
            loss.backward()
    assert handed == [1]  # compared beside .grad, then handed over as autograd's own
    assert verdict(lm.lm_head, "in_place_gradients/head") is True
    assert torch.equal(lm.lm_head.weight.grad, plain.lm_head.weight.grad)


@pytest.mark.unit
def test_a_users_own_backward_is_unchanged_bit_for_bit(tmp_path):
    lm = model(tmp_path, tied=True)
    plain, handed = tiled_pair(lm)
    got, expected = backward_all(lm, in_place=False), backward_all(plain, in_place=False)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    assert handed == [1, 1, 1]  # every backward handed autograd its gradient
    assert verdict(lm.lm_head, "in_place_gradients/head") is None  # never taken, never checked


@pytest.mark.unit
def test_padding_rows_take_nothing_and_repeated_tokens_sum():
    grad = torch.ones(6, 2)  # (V, H)
    ids = torch.tensor([4, 1, 4, 0, 4])  # (N,) 0 is the padding index
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [100.0, 100.0], [7.0, 8.0]])  # (N, H)
    in_place_gradients.add_rows(grad, ids, rows, padding_idx=0)
    assert grad.tolist() == [[1, 1], [4, 5], [1, 1], [1, 1], [14, 17], [1, 1]]
    dense = torch.ops.aten.embedding_dense_backward(rows, ids, 6, 0, False)  # (V, H) what autograd adds
    assert torch.equal(grad, torch.ones(6, 2) + dense)


@pytest.mark.unit
def test_a_first_in_place_sum_that_differs_is_caught_and_the_plain_gradient_handed_over(tmp_path, monkeypatch,
                                                                                          caplog):
    lm = model(tmp_path, tied=False)
    plain = copy.deepcopy(lm)
    vocab_chunks.use_vocab_chunks(lm), vocab_chunks.use_vocab_chunks(plain)
    use_in_place_gradients(lm)
    real_rows = in_place_gradients.row_sums
    monkeypatch.setattr(in_place_gradients, "row_sums",  # the embedding's rows 1% off
                        lambda ids, rows, pad: real_rows(ids, rows * 1.01, pad))
    monkeypatch.setattr(vocab_chunks, "largest_difference", lambda a, b: 1.0)  # the head's in-place sum off
    got, expected = backward_all(lm, in_place=True), backward_all(plain, in_place=False)
    assert verdict(lm.model.embed_tokens, "in_place_gradients/embedding") is False
    assert verdict(lm.lm_head, "in_place_gradients/head") is False
    assert "--no-in-place-gradients" in caplog.text
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # the plain gradients, bit for bit
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.unit
def test_the_adapter_gives_the_policy_the_ability_unless_switched_off(tiny_model_dir):
    from rlhf.plugins.models.config import HFModelConfig
    from rlhf.plugins.models.hf import HFModelAdapter

    on = HFModelAdapter(HFModelConfig(device="cpu")).load(str(tiny_model_dir), role="policy")
    off = HFModelAdapter(HFModelConfig(device="cpu", in_place_gradients=False)).load(str(tiny_model_dir),
                                                                                     role="policy")
    reference = HFModelAdapter(HFModelConfig(device="cpu")).load(str(tiny_model_dir), role="reference")
    assert isinstance(on.model.embed_tokens, in_place_gradients._InPlaceEmbedding)
    assert getattr(on.lm_head.weight, in_place_gradients.ALLOWED, False)
    assert not isinstance(off.model.embed_tokens, in_place_gradients._InPlaceEmbedding)
    assert not isinstance(reference.model.embed_tokens, in_place_gradients._InPlaceEmbedding)
    full_logits = HFModelAdapter(HFModelConfig(device="cpu", vocab_chunks=False)).load(str(tiny_model_dir),
                                                                                       role="policy")
    assert not getattr(full_logits.lm_head.weight, in_place_gradients.ALLOWED, False)  # untied, no tiles: autograd's
    assert getattr(full_logits.model.embed_tokens.weight, in_place_gradients.ALLOWED, False)


@pytest.mark.unit
def test_the_torch_backends_backward_accumulates_in_place(tmp_path):
    from rlhf.plugins.backends.config import BackendConfig
    from rlhf.plugins.backends.torch_backend import TorchBackend

    lm = model(tmp_path, tied=True)
    vocab_chunks.use_vocab_chunks(lm)
    use_in_place_gradients(lm)
    backend = TorchBackend(lm, BackendConfig(lr=1e-3, total_steps=1))
    handed = []
    lm.lm_head.weight.register_hook(lambda grad: handed.append(1) if grad is not None else None)
    for ids, mask, actions in micro_batches():
        backend.backward(token_logprobs(lm, ids, mask, actions)[0].sum())
    assert handed == []  # every backward added the weight's gradient in place
    assert lm.lm_head.weight.grad is not None and float(lm.lm_head.weight.grad.abs().max()) > 0


@pytest.mark.run
def test_a_run_trains_to_the_same_weights_with_and_without_in_place_gradients(tmp_path, task, plugins, monkeypatch):
    from safetensors.torch import load_file

    from rlhf.plugin_kit.tiny_model import build_random_model

    directory = build_random_model(tmp_path / "model", tied=True)
    rewards = tmp_path / "dense.py"  # every sample a different reward: the steps have real gradients
    rewards.write_text("def dense(completions, **kwargs):\n    return [sum(map(ord, c)) % 97 / 97 for c in completions]\n")
    handed = []
    real = in_place_gradients.grad_of
    for module in (in_place_gradients, vocab_chunks):  # the embedding's and the output layer's
        monkeypatch.setattr(module, "grad_of", lambda weight: handed.append(1) or real(weight))
    finals, metrics = {}, {}
    for flag in ("--in-place-gradients", "--no-in-place-gradients"):
        handed.clear()
        out = tmp_path / flag
        result = run_cli(plugins, ["train", "--model", str(directory), "--data", str(task / "data.jsonl"),
                                   "--reward", f"{rewards}:dense", "--lr", "1e-2", "--n-samples", "4",
                                   "--prompts-per-step", "4", "--micro-batch-size", "4", "--max-new-tokens", "8",
                                   "--steps", "2", "--out", str(out), "--no-progress", "--threads", "1", flag])
        assert result.exit_code == 0, result.output
        assert bool(handed) == (flag == "--in-place-gradients")  # .grad was written in place
        metrics[flag] = read_jsonl(out / "metrics.jsonl")
        finals[flag] = load_file(str(next((out / "final").glob("*.safetensors"))))
    expected, got = metrics["--no-in-place-gradients"], metrics["--in-place-gradients"]
    assert expected[-1]["policy/grad_norm"] > 1e-3
    for a, b in zip(got, expected):
        for key in ("reward/mean", "policy/loss", "policy/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    on, off = finals["--in-place-gradients"], finals["--no-in-place-gradients"]
    assert on.keys() == off.keys()
    assert any(not torch.equal(on[key], load) for key, load in
               load_file(str(next(directory.glob("*.safetensors")))).items() if key in on)  # it trained
    for key in on:  # Adam's step divides by the gradient's size: a near-zero entry's rounding moves it by up to lr
        difference = (on[key] - off[key]).abs()
        assert float(difference.max()) < 5e-3 * 1e-2 and float(difference.mean()) < 1e-7, key


@pytest.mark.unit
def test_the_accumulating_context_nests_and_ends_and_a_sparse_grad_is_left_to_autograd(tmp_path):
    lm = model(tmp_path, tied=True)
    use_in_place_gradients(lm)
    weight, owner = lm.lm_head.weight, lm.lm_head
    assert not in_place_gradients.in_place(weight, owner, "head")  # no backend's backward running
    with accumulating_in_place([weight]):
        with accumulating_in_place([weight]):
            assert in_place_gradients.in_place(weight, owner, "head")
        assert in_place_gradients.in_place(weight, owner, "head")  # the outer one still holds it
        weight.grad = torch.zeros_like(weight).to_sparse()  # e.g. an earlier sparse backward's
        assert not in_place_gradients.in_place(weight, owner, "head")
        weight.grad = None
        assert in_place_gradients.in_place(weight, owner, "head")
    assert not in_place_gradients.in_place(weight, owner, "head")  # ended: a user's backward hands over again
    assert in_place_gradients._ACCUMULATING == {}


@pytest.mark.unit
def test_the_checks_measures_see_every_row_and_an_all_padding_batch_agrees(tmp_path):
    a, b = torch.zeros(5, 3), torch.zeros(5, 3)
    b[0, 1] = 2.0  # only the first row differs
    assert in_place_gradients.largest_difference(a, b, rows=2) == 2.0
    b[0, 1], b[4, 2] = 0.0, -3.0  # only the last
    assert in_place_gradients.largest_difference(a, b, rows=2) == 3.0
    assert in_place_gradients.largest(torch.zeros(0, 3)) == 0.0
    embedding = torch.nn.Embedding(7, 3, padding_idx=0)
    assert use_in_place_gradients(torch.nn.Module()) == []  # no embedding, no output layer: nothing to give
    embedding.__class__ = in_place_gradients._in_place_class(torch.nn.Embedding)
    setattr(embedding.weight, in_place_gradients.ALLOWED, True)
    with accumulating_in_place([embedding.weight]):
        embedding(torch.zeros(2, 4, dtype=torch.long)).sum().backward()  # padding only: no row takes a gradient
    assert verdict(embedding, "in_place_gradients/embedding") is True
    assert torch.equal(embedding.weight.grad, torch.zeros(7, 3))


@pytest.mark.unit
def test_a_steps_scratch_buffer_is_held_while_its_window_lasts():
    scratch = in_place_gradients.step_scratch
    weight = torch.zeros(3, requires_grad=True)
    setattr(weight, in_place_gradients.ALLOWED, True)
    first = scratch(4, 10, torch.float32, "cpu")
    assert scratch(4, 10, torch.float32, "cpu").data_ptr() != first.data_ptr()  # no window: fresh ones
    assert in_place_gradients._SCRATCH == {}
    with accumulating_in_place([weight]):
        held = scratch(4, 10, torch.float32, "cpu")
        assert held.shape == (4, 10)
        assert scratch(4, 10, torch.float32, "cpu").data_ptr() == held.data_ptr()  # the next micro-batch's
        fewer = scratch(2, 10, torch.float32, "cpu")
        assert fewer.shape == (2, 10) and fewer.data_ptr() == held.data_ptr()
        more = scratch(6, 10, torch.float32, "cpu")  # more rows than held: a larger one, held from now on
        assert more.shape == (6, 10) and scratch(5, 10, torch.float32, "cpu").data_ptr() == more.data_ptr()
        assert scratch(6, 11, torch.float32, "cpu").data_ptr() != more.data_ptr()  # another width
        assert scratch(6, 10, torch.float64, "cpu").dtype == torch.float64
        with accumulating_in_place([weight]):
            assert scratch(6, 10, torch.float32, "cpu").data_ptr() == more.data_ptr()
        assert len(in_place_gradients._SCRATCH) == 3  # the outer window still holds them
    assert in_place_gradients._SCRATCH == {}  # freed with the step's last window
