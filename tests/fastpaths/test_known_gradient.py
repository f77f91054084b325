"""The output layer's backward done in its forward where the loss's gradient is known before it
(`rlhf.fastpaths.vocab_chunks._KnownGradientLogprobs`, `rlhf.core.logprobs.known_logprob_gradient`,
`PolicyTrainingLoss.logprob_gradient`):

* log-probs, ∂h and ∂W (added into ``.grad`` in the forward, or written there when it held none)
  equal the full logits' autograd, at temperatures 1 and 0.7, a few positions a chunk or all at
  once, with repeated targets, through torch's or oneDNN's products;
* a backward handed another gradient than the announced one is still exact (the difference goes
  through the tiles' backward), and one handed the announced gradient recomputes nothing;
* the loss's gradient: on-policy without a KL or entropy term it is the advantage over the token
  counts; with old log-probs, a KL term in the loss or an entropy bonus there is none;
* a policy update takes the same optimizer step with it as without it (prompts shared or not,
  packed), and runs it; with old log-probs or a KL term it never runs; outside a backend's step
  (no ``.grad`` may be written in a forward) it never runs;
* a first call that differs from the tiles is caught, warned about, and the tiles run from then on;
* ``rlhf train`` without a KL term runs it and matches ``--no-vocab-chunks``; a run stopped and
  resumed ends with the weights of an unbroken one, bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

from rlhf.core.logprobs import known_logprob_gradient
from rlhf.fastpaths import vocab_chunks
from rlhf.fastpaths.in_place_gradients import accumulating_in_place, use_in_place_gradients
from rlhf.fastpaths.verdicts import verdict
from tests.helpers import apply_calls, assert_same_gradients, grouped_batch


@pytest.fixture(autouse=True)
def always_tiles(monkeypatch):
    """The vocabulary path for every call here (small logits are otherwise taken whole)."""
    monkeypatch.setattr(vocab_chunks, "FULL_LOGITS_UP_TO", 0)


def known_calls(monkeypatch) -> list:
    """A list that grows by one at every known-gradient computation of log-probs."""
    return apply_calls(monkeypatch, vocab_chunks._KnownGradientLogprobs)


def layer(vocab=37, hidden=8, positions=11, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden, generator=generator) * 0.7).requires_grad_()  # (V, H)
    h = torch.randn(positions, hidden, generator=generator)  # (K, H)
    targets = torch.randint(0, vocab, (positions,), generator=generator)  # (K,)
    targets[3] = targets[5] = targets[0]  # repeated targets: their onehot rows add up
    grad = torch.randn(positions, generator=generator)  # (K,) ∂L/∂ℓ
    return weight, h, targets, grad


def by_full_logits(weight, h, targets, grad, temperature):
    """(ℓ, ∂h, ∂W) through the full logits and autograd."""
    w, x = weight.detach().clone().requires_grad_(), h.clone().requires_grad_()
    logprobs = torch.log_softmax(x @ w.t() / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # (K,)
    (logprobs * grad).sum().backward()
    return logprobs.detach(), x.grad, w.grad


def by_known_gradient(weight, h, targets, announced, handed, temperature, held=None, onednn=False):
    """(ℓ, ∂h, ∂W, ∂W after the forward) of `_KnownGradientLogprobs` announced ``announced`` and handed
    ``handed``, inside a backend's step (∂W into ``.grad``, which holds ``held`` before: an earlier
    micro-batch's gradient, or None); ``onednn``: its products through oneDNN."""
    weight.grad = None if held is None else held.clone()
    x = h.clone().requires_grad_()
    with accumulating_in_place([weight]):
        logprobs = vocab_chunks._KnownGradientLogprobs.apply(x, weight, targets, announced, temperature, onednn,
                                                             torch.nn.Module())  # (K,)
        in_forward = weight.grad.clone()
        (logprobs * handed).sum().backward()
    return logprobs.detach(), x.grad, weight.grad, in_forward


@pytest.mark.unit
@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [3, None])
def test_log_probs_and_gradients_equal_the_full_logits(monkeypatch, temperature, rows, held):
    weight, h, targets, grad = layer()
    if rows:
        monkeypatch.setattr(vocab_chunks, "KNOWN_GRADIENT_ELEMENTS", weight.shape[0] * rows)
    tiles_backward = []
    real = vocab_chunks._tiles_backward
    monkeypatch.setattr(vocab_chunks, "_tiles_backward", lambda *a, **k: tiles_backward.append(1) or real(*a, **k))
    before = torch.randn(weight.shape, generator=torch.Generator().manual_seed(9)) if held else None  # (V, H)
    expected = by_full_logits(weight, h, targets, grad, temperature)
    logprobs, grad_hidden, grad_weight, in_forward = by_known_gradient(weight, h, targets, grad, grad, temperature,
                                                                       before)
    assert torch.allclose(logprobs, expected[0], atol=1e-6)
    assert torch.allclose(grad_hidden, expected[1], atol=1e-6)
    assert torch.allclose(grad_weight, expected[2] + (before if held else 0), atol=1e-6)  # added to what .grad held
    assert torch.equal(in_forward, grad_weight)  # all of ∂W went in during the forward
    assert not tiles_backward  # the backward recomputed nothing


@pytest.mark.unit
def test_through_onednn_products(monkeypatch):
    from rlhf.fastpaths import cpu_linear

    if not cpu_linear.onednn_available():
        pytest.skip("this torch has no oneDNN")
    products = []
    real = cpu_linear.onednn_product
    monkeypatch.setattr(cpu_linear, "onednn_product", lambda *args: products.append(1) or real(*args))
    monkeypatch.setattr(vocab_chunks, "KNOWN_GRADIENT_ELEMENTS", 37 * 4)  # chunks of 4 positions
    weight, h, targets, grad = layer()
    expected = by_full_logits(weight, h, targets, grad, 0.7)
    got = by_known_gradient(weight, h, targets, grad, grad, 0.7, onednn=True)
    assert len(products) == 2 * 3  # z and p·W for each of the 3 chunks
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.unit
def test_a_backward_handed_another_gradient_is_still_exact(monkeypatch, caplog):
    weight, h, targets, grad = layer(seed=1)
    handed = grad * torch.linspace(-1.5, 2.0, grad.shape[0])  # (K,) not the announced one
    tiles_backward = []
    real = vocab_chunks._tiles_backward
    monkeypatch.setattr(vocab_chunks, "_tiles_backward", lambda *a, **k: tiles_backward.append(1) or real(*a, **k))
    expected = by_full_logits(weight, h, targets, handed, 0.7)
    with caplog.at_level("WARNING"):
        logprobs, grad_hidden, grad_weight, _ = by_known_gradient(weight, h, targets, grad, handed, 0.7)
    assert tiles_backward == [1]
    assert "was not the one it announced" in caplog.text
    assert torch.allclose(logprobs, expected[0], atol=1e-6)
    assert torch.allclose(grad_hidden, expected[1], atol=1e-5)
    assert torch.allclose(grad_weight, expected[2], atol=1e-5)


def grpo_loss(kl_coef=0.0, entropy_coef=0.0):
    from rlhf.algorithms import resolve_algorithm
    from rlhf.core.plugin_host.loading import build_plugin_manager

    algo = resolve_algorithm("grpo", n_samples=3, kl_coef=kl_coef, plugins=build_plugin_manager(load_entrypoints=False))
    return algo.policy_training_loss(None, entropy_coef=entropy_coef)


@pytest.mark.unit
def test_the_loss_gradient_on_policy_is_the_advantage_over_the_tokens():
    from rlhf.algorithms import step_norm

    batch = grouped_batch()
    norm = step_norm(batch, 8)
    grad = grpo_loss().logprob_gradient(batch, norm)  # (B, A)
    # token-mean: L = −Σ A·ratio / N over the step's loss tokens, ratio 1 with gradient 1 at any ℓ
    expected = -batch.advantages * batch.loss_mask / norm.num_tokens  # (B, A)
    assert torch.allclose(grad, expected, atol=1e-9) and bool((grad != 0).any())
    with_old = copy.copy(batch)
    with_old.old_logprobs = torch.full(batch.action_mask.shape, -2.0)
    assert grpo_loss().logprob_gradient(with_old, norm) is None  # the ratio follows ℓ
    with_ref = copy.copy(batch)
    with_ref.ref_logprobs = torch.full(batch.action_mask.shape, -2.0)
    assert grpo_loss(kl_coef=0.1).logprob_gradient(with_ref, norm) is None  # the KL term follows ℓ
    assert grpo_loss(entropy_coef=0.01).logprob_gradient(batch, norm) is None


def policy_update(model, batch, *, share=True, packing=False, micro=4, known=True, monkeypatch=None):
    """One GRPO update of ``batch`` on the torch backend (in-place gradients): the gradient of its
    optimizer step, its metrics."""
    from rlhf.plugins.backends.config import BackendConfig
    from rlhf.plugins.backends.torch_backend import TorchBackend
    from rlhf.runtime.rl.workers import PolicyWorker
    from rlhf.runtime.step.micro_batches import UpdateSettings

    steps = []

    class Recording(TorchBackend):
        def step(self):
            steps.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
            return super().step()

    settings = UpdateSettings(train_batch_size=batch.size, micro_batch_size=micro, max_new_tokens=8,
                              share_prompt=share, packing=packing)
    worker = PolicyWorker(model, Recording(model, BackendConfig(lr=1e-2)), settings, grpo_loss())
    if not known:
        monkeypatch.setattr(worker, "_known_gradient", lambda *a: contextlib.nullcontext())
    metrics = worker.fit(batch, step=0)
    assert len(steps) == 1
    return steps[0], metrics


@pytest.fixture
def lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    vocab_chunks.use_vocab_chunks(model)
    use_in_place_gradients(model)
    return model


@pytest.mark.unit
@pytest.mark.parametrize(("share", "packing", "micro"), [(True, False, 3), (False, False, 4), (False, True, 5)])
def test_a_policy_update_takes_the_same_step_with_it(lm, monkeypatch, share, packing, micro):
    batch = grouped_batch()
    expected, expected_metrics = policy_update(copy.deepcopy(lm), batch, share=share, packing=packing, micro=micro,
                                               known=False, monkeypatch=monkeypatch)
    calls = known_calls(monkeypatch)
    got, metrics = policy_update(lm, batch, share=share, packing=packing, micro=micro)
    # every micro-batch, the first of a fresh model too: a resumed run takes the same path at every step
    assert len(calls) == -(-batch.size // micro)
    assert verdict(lm.lm_head, "vocab_chunks/known_gradient") is True
    assert_same_gradients(got, expected, atol=1e-6)
    for key in ("policy/loss", "policy/grad_norm"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-5), key


@pytest.mark.unit
def test_old_log_probs_or_a_kl_term_never_take_it(lm, monkeypatch):
    from rlhf.plugins.backends.config import BackendConfig
    from rlhf.plugins.backends.torch_backend import TorchBackend
    from rlhf.runtime.rl.workers import PolicyWorker
    from rlhf.runtime.step.micro_batches import UpdateSettings

    calls = known_calls(monkeypatch)
    settings = UpdateSettings(train_batch_size=12, micro_batch_size=3, max_new_tokens=8, share_prompt=True)
    batch = grouped_batch()
    batch.old_logprobs = torch.full(batch.action_mask.shape, -3.0)
    PolicyWorker(lm, TorchBackend(lm, BackendConfig(lr=1e-2)), settings, grpo_loss()).fit(batch, step=0)
    batch = grouped_batch()
    batch.ref_logprobs = torch.full(batch.action_mask.shape, -3.0)
    PolicyWorker(lm, TorchBackend(lm, BackendConfig(lr=1e-2)), settings, grpo_loss(kl_coef=0.1)).fit(batch, step=0)
    assert not calls


@pytest.mark.unit
def test_outside_a_backends_step_no_gradient_is_written_in_a_forward(lm, monkeypatch):
    """A user's own forward and ``loss.backward()``: the gradients are handed to autograd, as always."""
    from rlhf.core.logprobs import token_logprobs

    calls = known_calls(monkeypatch)
    batch = grouped_batch()
    lm.zero_grad(set_to_none=True)
    with known_logprob_gradient(lambda: batch.advantages):
        logprobs, _ = token_logprobs(lm, batch.input_ids, batch.attention_mask, batch.action_mask)
    assert not calls and lm.lm_head.weight.grad is None
    (logprobs * batch.advantages).sum().backward()
    assert lm.lm_head.weight.grad is not None


@pytest.mark.unit
def test_a_first_call_that_differs_is_caught_and_the_tiles_run(lm, monkeypatch, caplog):
    batch = grouped_batch()
    expected, _ = policy_update(copy.deepcopy(lm), batch, known=False, monkeypatch=monkeypatch)
    real = vocab_chunks._known_gradient_pass

    def off(*args):
        logprobs, lse, grad_hidden = real(*args)
        return logprobs + 1e-2, lse, grad_hidden  # (K,) a wrong log-prob

    monkeypatch.setattr(vocab_chunks, "_known_gradient_pass", off)
    calls = known_calls(monkeypatch)
    with caplog.at_level("WARNING"):
        got, _ = policy_update(lm, batch, micro=3)
    assert verdict(lm.lm_head, "vocab_chunks/known_gradient") is False and not calls
    assert "known gradient" in caplog.text and "--no-vocab-chunks" in caplog.text
    assert_same_gradients(got, expected, atol=1e-6)


@pytest.mark.run
def test_rlhf_train_without_a_kl_term_takes_it_and_matches_the_plain_path(tiny_model_dir, task, tmp_path, plugins,
                                                                          monkeypatch):
    from tests.helpers import run_cli

    rewards = tmp_path / "dense.py"  # every sample a different reward: the step has a real loss and gradient
    rewards.write_text("def dense(completions, **kwargs):\n    return [sum(map(ord, c)) % 97 / 97 for c in completions]\n")
    calls = known_calls(monkeypatch)
    metrics = {}
    for flag in ("--vocab-chunks", "--no-vocab-chunks"):
        calls.clear()
        out = tmp_path / flag
        result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                                   "--reward", f"{rewards}:dense", "--lr", "1e-3", "--kl-coef", "0",
                                   "--n-samples", "4", "--prompts-per-step", "4", "--max-new-tokens", "8",
                                   "--micro-batch-size", "4", "--steps", "2", "--out", str(out), "--no-progress",
                                   "--threads", "1", flag])
        assert result.exit_code == 0, result.output
        assert bool(calls) == (flag == "--vocab-chunks")
        metrics[flag] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for got, expected in zip(metrics["--vocab-chunks"], metrics["--no-vocab-chunks"], strict=True):
        assert expected["policy/grad_norm"] > 1e-3
        for key in ("reward/mean", "policy/loss", "policy/grad_norm", "response/length_mean"):
            assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key


# A reward that varies by sample, sending SIGINT to its own process on call $SIGNAL_ON_CALL.
INTERRUPTING_REWARD = '''
import os, signal
from pathlib import Path

def dense(completions, **kwargs):
    counter = Path(os.environ["CALLS_FILE"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    if calls == int(os.environ.get("SIGNAL_ON_CALL", "0")):
        os.kill(os.getpid(), signal.SIGINT)
    return [sum(map(ord, c)) % 97 / 97 for c in completions]
'''


@pytest.mark.run
def test_a_resumed_run_ends_where_an_unbroken_one_does(tiny_model_dir, task, tmp_path, monkeypatch):
    """The path a micro-batch takes does not depend on what ran before it in the process: stopped
    after step 2 and resumed, the run's final weights are those of an unbroken run, bit for bit."""
    from rlhf.core.errors import RunInterrupted
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.rl.local import train
    from tests.helpers import final_weights, small_config

    rewards = tmp_path / "dense.py"
    rewards.write_text(INTERRUPTING_REWARD)
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    plugins = build_plugin_manager(load_entrypoints=False)

    def config(out, **overrides):
        return small_config(tiny_model_dir, task, out, reward=[f"{rewards}:dense"], kl_coef=0.0, n_samples=4,
                            max_new_tokens=8, micro_batch_size=4, steps=3, **overrides)

    calls = known_calls(monkeypatch)
    whole = train(config(tmp_path / "whole"), plugins=plugins)
    assert len(calls) == 6  # 2 prompts x 4 samples a step in micro-batches of 4, each through the known gradient
    (tmp_path / "calls").unlink()
    monkeypatch.setenv("SIGNAL_ON_CALL", "2")
    with pytest.raises(RunInterrupted):
        train(config(tmp_path / "stopped"), plugins=plugins)
    monkeypatch.setenv("SIGNAL_ON_CALL", "0")
    train(config(tmp_path / "stopped", resume=True), plugins=plugins)
    got, expected = final_weights(tmp_path / "stopped"), final_weights(whole)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())
