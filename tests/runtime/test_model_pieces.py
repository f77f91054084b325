"""Log-probs, the hf engine, the torch backend, batching and checkpoints, on the tiny model."""

from __future__ import annotations

import copy as copy_module
import math

import pytest
import torch

from rlhf.core.protocols.rollout import SamplingParams
from rlhf.core.types import Trajectory
from rlhf.runtime.run import checkpoint
from rlhf.plugins.backends.torch_backend import BackendConfig, TorchBackend, lr_factor
from rlhf.core.batch import collate
from tests.helpers import assert_engine_logprobs_are_the_trainers
from rlhf.plugins.engines.hf import HFEngine
from rlhf.core.logprobs import token_logprobs


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def _trajectory(prompt, completion, group=0):
    return Trajectory(token_ids=prompt + completion, loss_mask=[0] * len(prompt) + [1] * len(completion),
                      prompt_length=len(prompt), prompt="", prompt_text="", completion_text="", group=group)


@pytest.mark.unit
def test_collate_right_pads_and_shifts_the_action_mask():
    batch = collate([_trajectory([5, 6], [7, 8, 9]), _trajectory([5], [7])], pad_token_id=0,
                    rewards=torch.tensor([1.0, 0.0]), sample_mask=torch.tensor([1.0, 1.0]))
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # position t holds the action that produces token t+1
    assert batch.action_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    trimmed = batch.select([1])
    assert trimmed.input_ids.tolist() == [[5, 7]] and trimmed.action_mask.tolist() == [[1]]


@pytest.mark.unit
def test_token_logprobs_match_a_full_manual_computation(model_and_tokenizer):
    model, _ = model_and_tokenizer
    batch = collate([_trajectory([3, 4, 5], [6, 7]), _trajectory([3], [9, 10, 11, 12])], pad_token_id=0,
                    rewards=torch.zeros(2), sample_mask=torch.ones(2))
    with torch.no_grad():
        logprobs, entropy = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask,
                                           temperature=0.7, with_entropy=True)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float() / 0.7
    full = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, A, V)
    expected = full.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # (B, A)
    mask = batch.action_mask.bool()
    assert torch.allclose(logprobs[mask], expected[mask], atol=1e-5)
    expected_entropy = -(full.exp() * full).sum(-1)
    assert torch.allclose(entropy[mask], expected_entropy[mask], atol=1e-4)


@pytest.mark.unit
def test_half_precision_logits_are_turned_into_log_probs_in_float32(model_and_tokenizer):
    import copy

    model = copy.deepcopy(model_and_tokenizer[0]).to(torch.bfloat16)
    batch = collate([_trajectory([3, 4, 5], [6, 7, 8])], pad_token_id=0, rewards=torch.zeros(1), sample_mask=torch.ones(1))
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]  # bf16
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.action_mask.bool()
    assert logprobs.dtype == torch.float32
    assert torch.allclose(logprobs[mask], expected[mask], atol=1e-6)


@pytest.mark.run
def test_engine_samples_from_exactly_the_distribution_the_trainer_scores(model_and_tokenizer):
    """top-k must be off: the engine's own (processed) log-probs equal the trainer's."""
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    engine = HFEngine(model, tokenizer)
    prompts = [tokenizer("What is 12 + 7?")["input_ids"], tokenizer("hello")["input_ids"]]
    params = SamplingParams(max_new_tokens=6, temperature=0.7, return_logprobs=True)
    generations = engine.generate(prompts, n=3, params=params)
    assert len(generations) == 6
    assert_engine_logprobs_are_the_trainers(model, tokenizer, [prompts[i // 3] for i in range(6)], generations,
                                            temperature=0.7)


@pytest.mark.run
def test_transformers_generate_path_gives_the_trainers_logprobs_too(model_and_tokenizer):
    """Stop strings take transformers' generate (not the direct decoder); its per-step scores give
    the same log-probs, one step at a time."""
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    engine = HFEngine(model, tokenizer)
    prompts = [tokenizer("What is 12 + 7?")["input_ids"], tokenizer("hello")["input_ids"]]
    params = SamplingParams(max_new_tokens=6, temperature=0.7, return_logprobs=True, stop=["never-seen-stop"])
    assert not engine.uses_direct_decoder(params)
    generations = engine.generate(prompts, n=2, params=params)
    assert all(g.logprobs is not None and len(g.logprobs) == len(g.token_ids) for g in generations)
    assert_engine_logprobs_are_the_trainers(model, tokenizer, [prompts[i // 2] for i in range(4)], generations,
                                            temperature=0.7)


@pytest.mark.run
def test_engine_lays_out_n_samples_per_prompt_contiguously(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    prompts = [tokenizer("What is 12 + 7?")["input_ids"], tokenizer("Say hello")["input_ids"]]
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    together = engine.generate(prompts, n=2, params=greedy)
    alone = [engine.generate([p], n=1, params=greedy)[0].token_ids for p in prompts]
    assert [g.token_ids for g in together] == [alone[0], alone[0], alone[1], alone[1]]
    assert all(g.finish_reason in ("stop", "length") for g in together)


@pytest.mark.unit
def test_engine_cuts_at_eos_and_at_stop_strings(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    params = SamplingParams(max_new_tokens=5)
    done = engine._to_generation(torch.tensor([11, 12, eos, pad, pad]), None, params)
    assert (done.token_ids, done.finish_reason) == ([11, 12, eos], "stop")
    full = engine._to_generation(torch.tensor([11, 12, 13, 14, 15]), None, params)
    assert (full.token_ids, full.finish_reason) == ([11, 12, 13, 14, 15], "length")
    ids = tokenizer("x = 1\n```\nmore text", add_special_tokens=False)["input_ids"]
    stopped = engine._to_generation(torch.tensor(ids + [pad, pad]), None,
                                    SamplingParams(max_new_tokens=20, stop=("```",)))
    assert stopped.finish_reason == "stop" and stopped.stop_string == "```"
    text = tokenizer.decode(stopped.token_ids)
    assert "```" in text and "more" not in text and not tokenizer.decode(stopped.token_ids[:-1]).count("```")


@pytest.mark.unit
def test_lr_schedule_warmup_then_constant_or_cosine():
    constant = BackendConfig(warmup_steps=2, total_steps=10)
    assert [lr_factor(s, constant) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cosine = BackendConfig(warmup_steps=0, total_steps=10, lr_scheduler="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, cosine) == pytest.approx(1.0)
    assert lr_factor(5, cosine) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(10, cosine) == pytest.approx(0.1)


@pytest.mark.unit
def test_backend_skips_nonfinite_gradients_and_restores_state_exactly():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    backend = TorchBackend(model, BackendConfig(lr=0.1, max_grad_norm=1.0))
    before = model.weight.detach().clone()
    (model(torch.ones(1, 3)).sum() * float("nan")).backward()
    stats = backend.step()
    assert stats["skipped"] == 1.0 and math.isnan(stats["grad_norm"])
    assert torch.equal(model.weight, before) and model.weight.grad is None

    def train_step(m, b):
        m(torch.arange(3.0)[None]).pow(2).sum().backward()
        return b.step()

    train_step(model, backend)
    saved = copy_module.deepcopy((model.state_dict(), backend.state_dict()))  # state_dict() aliases live tensors
    train_step(model, backend)
    expected = model.weight.detach().clone()

    copy = torch.nn.Linear(3, 1)
    copy.load_state_dict(saved[0])
    restored = TorchBackend(copy, BackendConfig(lr=0.1, max_grad_norm=1.0))
    restored.load_state_dict(saved[1])
    train_step(copy, restored)
    assert torch.equal(copy.weight, expected)


class _Saved:
    """A stand-in worker: checkpoints call save/load on it."""

    def __init__(self, value):
        self.value = value

    def save(self, directory):
        directory.mkdir(parents=True)
        (directory / "value.txt").write_text(str(self.value))

    def load(self, directory):
        self.value = int((directory / "value.txt").read_text())


@pytest.mark.unit
def test_checkpoints_are_atomic_rotated_and_carry_rng(tmp_path):
    (tmp_path / "checkpoints" / ".step_9.tmp").mkdir(parents=True)  # a crash mid-write
    torch.manual_seed(5)
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(tmp_path, step, workers={"policy": _Saved(step)},
                                   trainer_state={"loader": {"epoch": 0, "position": step}}, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    expected = torch.rand(3)  # what the RNG gives right after the step-3 checkpoint
    torch.manual_seed(99)
    restored = _Saved(0)
    trainer_state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path), {"policy": restored})
    assert restored.value == 3 and trainer_state == {"step": 3, "loader": {"epoch": 0, "position": 3}}
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.unit
def test_length_sorted_micro_batches_cover_every_row_once_and_results_keep_row_order(model_and_tokenizer):
    from rlhf.core.distributed import SINGLE
    from rlhf.runtime.step.micro_batches import micro_batches
    from rlhf.runtime.rl.workers import forward_rows

    model, _ = model_and_tokenizer
    lengths = [(2, 9), (3, 1), (1, 6), (4, 2), (2, 4)]  # (prompt, completion) lengths, deliberately unsorted
    trajectories = [_trajectory(list(range(5, 5 + p)), list(range(40, 40 + c)), group=i) for i, (p, c) in enumerate(lengths)]
    batch = collate(trajectories, pad_token_id=0, rewards=torch.zeros(5), sample_mask=torch.ones(5))
    pieces = micro_batches(batch, 2)
    assert sorted(int(r) for rows, _ in pieces for r in rows) == [0, 1, 2, 3, 4]
    sizes = [int(micro.attention_mask.sum(dim=1).max()) for _, micro in pieces]
    assert sizes == sorted(sizes) and sizes[0] < batch.input_ids.shape[1]  # short rows together, less padding
    with torch.no_grad():
        sorted_lp = forward_rows(batch, SINGLE, 2, lambda micro: token_logprobs(
            model, micro.batch.input_ids, micro.batch.attention_mask, micro.batch.action_mask)[0])
        whole_lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
    mask = batch.action_mask.bool()
    assert torch.allclose(sorted_lp[mask], whole_lp[mask], atol=1e-5)
