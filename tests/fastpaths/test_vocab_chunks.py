"""Log-probs from hidden states, the vocabulary a chunk of positions at a time
(rlhf/fastpaths/vocab_chunks.py, on unless ``--no-vocab-chunks``):

* log-probs, entropy and every gradient equal the full-logits path's, on the padded, packed and
  shared-prompt (masked and segment) forwards, at temperatures 1 and 0.7, in tiles of 3 positions
  x 1 or 7 vocabulary entries and in one tile, through torch's and oneDNN's products, with a biased output layer;
* distillation's cross-entropy to a teacher (another hidden size; logits at -inf) and its
  gradients equal `rlhf.objectives.distillation_loss`'s;
* a block of logits all at −inf, or far below the rest, and repeated targets: the same log-probs
  and gradients as log_softmax; tiles are 512 KB on a CPU and keep their earlier 32 MB elsewhere;
* the backward keeps no tensor of (positions x vocabulary) elements;
* a model whose logits are not its output layer's output (capped, scaled) keeps the plain path; a
  ZeRO-3 partitioned layer does not defer; a chunked result that differs is caught and replaced;
* the adapter gives the policy and reference the ability; ``--no-vocab-chunks`` does not, and a
  policy step takes the same optimizer step either way.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.core.logprobs import deferred_head, token_logprobs
from rlhf.fastpaths import vocab_chunks
from rlhf.fastpaths.cpu_linear import use_onednn_linears
from rlhf.fastpaths.packing import PackedModel
from rlhf.fastpaths.prefix_sharing import share_prefixes, shared_token_logprobs
from rlhf.fastpaths.verdicts import verdict
from tests.helpers import padded_batch
from tests.helpers import apply_calls, assert_same_gradients, shared_batch


@pytest.fixture(autouse=True)
def always_tiles(monkeypatch):
    """Tiles for every call here (by default a call with a backward and small logits takes them whole)."""
    monkeypatch.setattr(vocab_chunks, "FULL_LOGITS_UP_TO", 0)


def tile_calls(monkeypatch) -> list:
    """A list that grows by one at every tiled computation of log-probs."""
    return apply_calls(monkeypatch, vocab_chunks._ChunkedLogprobs)


@pytest.fixture
def lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")


def run(model, forward, actions):
    """(log-probs, entropy, gradients) of ``forward()`` with a loss that weighs both."""
    model.zero_grad()
    logprobs, entropy = forward()
    weights = torch.randn(actions.shape, generator=torch.Generator().manual_seed(3))  # (B, A)
    ((logprobs * weights + 0.3 * entropy * weights.flip(0)) * actions).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach() * actions, entropy.detach() * actions, grads


def assert_same(got, expected):
    assert torch.allclose(got[0], expected[0], atol=1e-5)
    assert torch.allclose(got[1], expected[1], atol=1e-5)
    assert got[2].keys() == expected[2].keys()
    assert_same_gradients(got[2], expected[2], atol=1e-5)


# one vocabulary entry a tile is seconds of small products: out of the quick tier
@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.run), pytest.param(7, marks=pytest.mark.unit),
                                   pytest.param(None, marks=pytest.mark.unit)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("path", ["padded", "packed", "shared/masked", "shared/segment"])
def test_chunked_logprobs_entropy_and_gradients_equal_the_full_logits(lm, monkeypatch, path, temperature, chunk):
    # tiles of 3 positions x `chunk` vocabulary entries (one of 1, of 7), or one tile
    monkeypatch.setattr(vocab_chunks, "TILE_POSITIONS", 3 if chunk else 4096)
    monkeypatch.setattr(vocab_chunks, "MIN_BLOCK", 1)
    monkeypatch.setattr(vocab_chunks, "TILE_ELEMENTS", 3 * chunk if chunk else 1 << 30)
    if path == "shared/segment":
        import rlhf.fastpaths.prefix_sharing as prefix_sharing

        monkeypatch.setattr(prefix_sharing, "segments_pay", lambda layout: True)
    chunked = copy.deepcopy(lm)
    assert vocab_chunks.use_vocab_chunks(chunked) and deferred_head(chunked) is chunked.lm_head
    if path.startswith("shared"):
        ids, mask, actions, groups = shared_batch()
        rows = share_prefixes(ids, mask, groups)

        def forward(model):
            return lambda: shared_token_logprobs(model, rows, ids, actions, temperature=temperature,
                                                 with_entropy=True)
    else:
        ids, mask, actions = padded_batch()

        def forward(model):
            wrapped = PackedModel(model) if path == "packed" else model
            return lambda: token_logprobs(wrapped, ids, mask, actions, temperature=temperature, with_entropy=True)

    expected = run(lm, forward(lm), actions)
    got = run(chunked, forward(chunked), actions)
    assert_same(got, expected)
    assert (expected[0][actions.bool()] < 0).all()  # real log-probs were compared
    assert verdict(chunked.lm_head, "vocab_chunks") is True


@pytest.mark.unit
def test_onednn_products_and_a_biased_output_layer(lm, monkeypatch):
    from rlhf.fastpaths import cpu_linear

    if not cpu_linear.onednn_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(cpu_linear, "ONEDNN_FROM", 1)
    monkeypatch.setattr(vocab_chunks, "TILE_ELEMENTS", lm.lm_head.weight.shape[0] * 5)
    biased = torch.nn.Linear(lm.lm_head.in_features, lm.lm_head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(lm.lm_head.weight)
        biased.bias.normal_(generator=torch.Generator().manual_seed(0))
    lm.lm_head = biased
    use_onednn_linears(lm, "onednn")
    chunked = copy.deepcopy(lm)
    assert vocab_chunks.use_vocab_chunks(chunked)
    assert isinstance(chunked.lm_head, cpu_linear.OneDnnLinear)
    products = []
    real = cpu_linear.onednn_product
    monkeypatch.setattr(cpu_linear, "onednn_product", lambda *args: products.append(1) or real(*args))
    ids, mask, actions = padded_batch()
    expected = run(lm, lambda: token_logprobs(lm, ids, mask, actions, temperature=0.7, with_entropy=True), actions)
    products.clear()
    got = run(chunked, lambda: token_logprobs(chunked, ids, mask, actions, temperature=0.7, with_entropy=True),
              actions)
    assert_same(got, expected)
    assert "lm_head.bias" in got[2]
    assert len(products) > 0


@pytest.mark.unit
@pytest.mark.parametrize("chunk", [1, 3, None])
def test_the_cross_entropy_to_a_teacher_and_its_gradients_equal_the_full_logits(lm, monkeypatch, chunk):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.objectives import distillation_loss

    vocab = lm.lm_head.weight.shape[0]
    monkeypatch.setattr(vocab_chunks, "CHUNK_ELEMENTS", vocab * chunk if chunk else 1 << 30)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2)).eval()
    biased = torch.nn.Linear(lm.lm_head.in_features, vocab, bias=True)  # some student logits at -inf
    with torch.no_grad():
        biased.weight.copy_(lm.lm_head.weight)
        biased.bias.zero_()
        biased.bias[[3, 7, 100]] = float("-inf")
    lm.lm_head = biased
    chunked, chunked_teacher = copy.deepcopy(lm), copy.deepcopy(teacher)
    assert vocab_chunks.use_vocab_chunks(chunked) and vocab_chunks.use_vocab_chunks(chunked_teacher)
    ids, mask, actions = padded_batch()
    learnt = actions.bool()  # (B, A): position t predicts token t + 1

    lm.zero_grad()
    logits = lm(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, A, V)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=mask).logits[:, :-1]
    expected = distillation_loss(logits, teacher_logits, actions)
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    student, head_of_teacher = deferred_head(chunked), deferred_head(chunked_teacher)
    with student.hidden_states_out():
        hidden = chunked(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, A, H)
    with torch.no_grad(), head_of_teacher.hidden_states_out():
        teacher_hidden = chunked_teacher(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, A, 32)
    got = student.cross_entropy_to(hidden[learnt], head_of_teacher, teacher_hidden[learnt]).mean()
    got.backward()
    grads = {n: p.grad.clone() for n, p in chunked.named_parameters() if p.grad is not None}
    assert torch.isfinite(expected) and got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert grads.keys() == expected_grads.keys() and "lm_head.bias" in grads
    assert_same_gradients(grads, expected_grads, atol=1e-5)
    assert verdict(chunked.lm_head, "vocab_chunks/distill") is True
    assert all(p.grad is None for p in chunked_teacher.parameters())


@pytest.mark.unit
def test_the_backward_keeps_no_full_vocabulary_tensor(lm, monkeypatch):
    vocab = lm.lm_head.weight.shape[0]
    monkeypatch.setattr(vocab_chunks, "TILE_ELEMENTS", vocab * 4)
    ids, mask, actions = padded_batch()
    positions = actions.shape[0] * actions.shape[1]  # (B·A) scored positions at most

    def largest_saved(model):
        sizes = []

        def pack(tensor):
            sizes.append(tensor.numel() if tensor.shape[-1:] == (vocab,) and tensor.dim() > 1 else 0)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logprobs, entropy = token_logprobs(model, ids, mask, actions, with_entropy=True)
        return max(sizes)

    chunked = copy.deepcopy(lm)
    vocab_chunks.use_vocab_chunks(chunked)
    assert largest_saved(lm) >= positions // 2 * vocab  # the plain path keeps (B, A', V) logits
    assert largest_saved(chunked) == 0  # only the output layer's (V, H) weight: not (positions, V)


@pytest.mark.unit
@pytest.mark.parametrize("positions", [3, 512])
def test_blocks_at_minus_infinity_or_far_below_the_rest_and_repeated_targets(monkeypatch, positions):
    """A block whose logits are all −inf, one whose max is 300 below the row's (its exp(m − M) is 0
    in float32), targets inside it and repeated (the onehot term summed, not overwritten): the
    same log-probs and gradients as log_softmax over the full logits; the weight's gradient summed
    over chunks of 3 positions, or written by one chunk."""
    monkeypatch.setattr(vocab_chunks, "TILE_POSITIONS", positions)
    monkeypatch.setattr(vocab_chunks, "MIN_BLOCK", 1)
    monkeypatch.setattr(vocab_chunks, "TILE_ELEMENTS", 3 * 7)  # 3 positions: blocks of 7
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=generator).requires_grad_()  # (K, H)
    weight = torch.randn(40, 16, generator=generator).requires_grad_()  # (V, H)
    bias = torch.zeros(40)
    bias[:7], bias[7:14] = float("-inf"), -300.0
    bias.requires_grad_()
    targets = torch.tensor([8, 8, 13, 20, 20, 20, 39, 7, 14, 30])  # (K,)
    weights = torch.randn(10, generator=generator)  # (K,)

    def gradients(logprobs):
        (logprobs * weights).sum().backward()
        grads = (hidden.grad.clone(), weight.grad.clone(), bias.grad.clone())
        hidden.grad = weight.grad = bias.grad = None
        return grads

    plain = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias) / 0.7, dim=-1)  # (K, V)
    expected = plain.gather(-1, targets[:, None]).squeeze(-1)  # (K,)
    expected_grads = gradients(expected)
    got, entropy = vocab_chunks._ChunkedLogprobs.apply(hidden, weight, bias, targets, 0.7, False, False)
    assert entropy.numel() == 0
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-5) and (got[:3] < -300).all()
    for a, b in zip(gradients(got), expected_grads):
        assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-5)
    assert (expected_grads[1][:7] == 0).all() and expected_grads[1][8].abs().sum() > 0


@pytest.mark.unit
def test_tiles_fit_a_cpu_cache_and_keep_their_earlier_size_elsewhere():
    cpu = list(vocab_chunks._tiles(1000, 151_936, torch.device("cpu")))
    assert [(first, end) for first, end, _ in cpu] == [(0, 512), (512, 1000)]
    assert cpu[0][2][:2] == [(0, 256), (256, 512)] and cpu[0][2][-1] == (151_808, 151_936)
    assert len(cpu[1][2][0]) == 2 and cpu[1][2][0][1] == 268  # 2¹⁷ / 488 positions
    elsewhere = list(vocab_chunks._tiles(5000, 151_936, torch.device("meta")))
    assert [(first, end) for first, end, _ in elsewhere] == [(0, 4096), (4096, 5000)]
    assert elsewhere[0][2][0] == (0, 2048)  # 2²³ / 4096


@pytest.mark.unit
def test_a_model_that_caps_its_logits_keeps_the_plain_path(caplog):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=3.0)
    model = Gemma2ForCausalLM(config)
    with caplog.at_level("INFO"):
        assert vocab_chunks.use_vocab_chunks(model) is False
    assert deferred_head(model) is None and "post-processes its logits" in caplog.text
    config.final_logit_softcapping = None
    assert vocab_chunks.use_vocab_chunks(Gemma2ForCausalLM(config)) is True


@pytest.mark.unit
def test_a_partitioned_output_layer_does_not_defer(lm):
    vocab_chunks.use_vocab_chunks(lm)
    lm.lm_head.weight.ds_id = 7  # what DeepSpeed ZeRO-3 marks a partitioned parameter with
    assert deferred_head(lm) is None
    ids, mask, actions = padded_batch()
    logprobs, _ = token_logprobs(lm, ids, mask, actions)  # the model's own logits
    assert (logprobs[actions.bool()] < 0).all()


@pytest.mark.unit
def test_chunked_logprobs_that_differ_are_caught_and_the_plain_path_runs(lm, monkeypatch, caplog):
    expected_model = copy.deepcopy(lm)
    vocab_chunks.use_vocab_chunks(lm)
    real = vocab_chunks._ChunkedLogprobs.apply
    monkeypatch.setattr(vocab_chunks._ChunkedLogprobs, "apply",
                        lambda *args: tuple(t + 0.1 if t.numel() else t for t in real(*args)))
    ids, mask, actions = padded_batch()
    with caplog.at_level("WARNING"):
        got = run(lm, lambda: token_logprobs(lm, ids, mask, actions, with_entropy=True), actions)
    assert verdict(lm.lm_head, "vocab_chunks") is False
    assert "vocab_chunks differs from the plain path" in caplog.text and "--no-vocab-chunks" in caplog.text
    assert deferred_head(lm) is None
    expected = run(expected_model, lambda: token_logprobs(expected_model, ids, mask, actions, with_entropy=True),
                   actions)
    assert_same(got, expected)


@pytest.mark.unit
@pytest.mark.parametrize("on", [True, False])
def test_the_adapter_gives_policy_and_reference_vocab_chunks_unless_switched_off(tiny_model_dir, on):
    from rlhf.plugins.models.hf import HFModelAdapter, HFModelConfig

    adapter = HFModelAdapter(HFModelConfig(device="cpu", vocab_chunks=on))
    for role in ("policy", "reference"):
        assert (deferred_head(adapter.load(str(tiny_model_dir), role=role)) is not None) is on, role
    lora = HFModelAdapter(HFModelConfig(device="cpu", vocab_chunks=on, lora_rank=4))
    policy = lora.load(str(tiny_model_dir), role="policy")
    assert (deferred_head(policy) is not None) is on  # under PEFT's wrapper
    assert (deferred_head(lora.load(str(tiny_model_dir), role="reference")) is not None) is on


@pytest.mark.unit
@pytest.mark.parametrize(("micro", "epochs", "share"), [(4, 1, True), (6, 2, False)])
def test_a_policy_step_is_the_same_with_vocab_chunks(lm, monkeypatch, micro, epochs, share):
    from tests.helpers import grouped_batch
    from tests.runtime.recording import policy_step

    monkeypatch.setattr(vocab_chunks, "TILE_ELEMENTS", lm.lm_head.weight.shape[0] * 6)
    chunked = copy.deepcopy(lm)
    vocab_chunks.use_vocab_chunks(chunked)
    batch = grouped_batch()
    expected, expected_metrics, expected_logprobs = policy_step(lm, batch, share=share, micro_batch_size=micro,
                                                                ppo_epochs=epochs)
    got, metrics, logprobs = policy_step(chunked, batch, share=share, micro_batch_size=micro, ppo_epochs=epochs)
    assert len(got) == len(expected) == epochs
    for a, b in zip(got, expected):
        assert_same_gradients(a, b, atol=1e-5)
    for key in ("policy/loss", "policy/entropy", "policy/clip_frac"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
    assert torch.allclose(logprobs * batch.action_mask, expected_logprobs * batch.action_mask, atol=1e-5)


@pytest.mark.run
def test_the_cli_switch_reaches_the_run_and_the_runs_match(tiny_model_dir, task, tmp_path, plugins, monkeypatch):
    """`rlhf train` takes the chunked path by default and the full logits with ``--no-vocab-chunks``;
    a step's metrics agree to float rounding."""
    import json

    from tests.helpers import run_cli

    rewards = tmp_path / "dense.py"  # every sample a different reward: the step has a real loss and gradient
    rewards.write_text("def dense(completions, **kwargs):\n    return [sum(map(ord, c)) % 97 / 97 for c in completions]\n")
    calls = tile_calls(monkeypatch)
    metrics = {}
    for flag in ("--vocab-chunks", "--no-vocab-chunks"):
        calls.clear()
        out = tmp_path / flag
        result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                                   "--reward", f"{rewards}:dense", "--lr", "1e-3", "--kl-coef", "0.1",
                                   "--n-samples", "4", "--prompts-per-step", "4", "--max-new-tokens", "8",
                                   "--steps", "1", "--out", str(out), "--no-progress", "--threads", "1", flag])
        assert result.exit_code == 0, result.output
        assert bool(calls) == (flag == "--vocab-chunks")
        metrics[flag] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    expected, got = metrics["--no-vocab-chunks"], metrics["--vocab-chunks"]
    assert expected["policy/grad_norm"] > 1e-3 and expected["reward/std"] > 0
    for key in ("reward/mean", "policy/loss", "policy/grad_norm", "policy/kl", "response/length_mean"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key


@pytest.mark.run
@pytest.mark.parametrize("command", ["sft", "dpo", "kto", "prm", "distill"])
def test_fit_commands_take_the_same_steps_with_vocab_chunks(tiny_model_dir, fit_data, fit_teacher, tmp_path,
                                                            monkeypatch, command):
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from tests.helpers import command_args, read_jsonl, run_cli
    from tests.runtime.recording import RecordingBackend, recording_plugin

    calls = tile_calls(monkeypatch)
    runs = {}
    for flag in ("--vocab-chunks", "--no-vocab-chunks"):
        calls.clear()
        plugins = build_plugin_manager(load_entrypoints=False)
        plugins.register(recording_plugin())
        RecordingBackend.steps.clear()
        out = tmp_path / flag
        result = run_cli(plugins, command_args(command, tiny_model_dir, fit_data, fit_teacher) + [
            "--batch-size", "4", "--micro-batch-size", "2", "--steps", "2", "--lr", "0.1",
            "--backend", "recording", "--out", str(out), "--no-progress", flag])
        assert result.exit_code == 0, result.output
        assert bool(calls) == (flag == "--vocab-chunks" and command != "prm")  # prm: placeholders' logits only
        runs[flag] = list(RecordingBackend.steps), read_jsonl(out / "metrics.jsonl")
    (steps, metrics), (expected_steps, expected_metrics) = runs["--vocab-chunks"], runs["--no-vocab-chunks"]
    assert len(steps) == len(expected_steps) == 2
    for a, b in zip(steps, expected_steps):
        assert_same_gradients(a, b, atol=1e-5)
    for a, b in zip(metrics, expected_metrics):
        for key in {"train/loss", "train/sft_loss", "train/kd_loss", "train/accuracy"} & b.keys():
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.unit
def test_small_logits_are_taken_whole_with_or_without_a_backward(lm, monkeypatch):
    """Whole up to the budget (no tiles to recompute), and the same bits with a backward or without
    one: a policy and its frozen reference agree exactly on the same weights."""
    monkeypatch.setattr(vocab_chunks, "FULL_LOGITS_UP_TO", 256 << 20)
    calls = tile_calls(monkeypatch)
    plain = copy.deepcopy(lm)
    vocab_chunks.use_vocab_chunks(lm)
    ids, mask, actions = padded_batch()
    with_backward, _ = token_logprobs(lm, ids, mask, actions, temperature=2.0)
    with torch.no_grad():
        without, _ = token_logprobs(lm, ids, mask, actions, temperature=2.0)
        expected, _ = token_logprobs(plain, ids, mask, actions, temperature=2.0)
        at_one, _ = token_logprobs(lm, ids, mask, actions, temperature=1.0)
    assert not calls and with_backward.requires_grad  # (B·A) x 320 floats: whole
    assert torch.equal(with_backward.detach(), without)
    assert torch.allclose(without * actions, expected * actions, atol=1e-6)
    assert not torch.allclose(at_one * actions, without * actions, atol=1e-3)  # τ = 2 was applied
    monkeypatch.setattr(vocab_chunks, "FULL_LOGITS_UP_TO", 4 * 320 * 3)  # 3 positions' logits: these are more
    with torch.no_grad():
        tiled, _ = token_logprobs(lm, ids, mask, actions, temperature=2.0)
    assert len(calls) == 2  # the first call's check, then the tiles
    assert torch.allclose(tiled * actions, expected * actions, atol=1e-5)


@pytest.mark.unit
def test_no_positions_give_no_gradient():
    """A micro-batch with nothing to score: the tiles' backward hands back zeros, not an
    uninitialised (V, H) tensor (no product ever writes it)."""
    weight = torch.randn(37, 8, requires_grad=True)  # (V, H)
    hidden = torch.randn(0, 8, requires_grad=True)  # (0, H)
    logprobs, _ = vocab_chunks._ChunkedLogprobs.apply(hidden, weight, None, torch.zeros(0, dtype=torch.long), 1.0,
                                                      False, False)
    (logprobs * 2).sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))
