"""Sample packing and token-budget micro-batches (rlhf/fastpaths/packing.py, ``--packing``,
``--max-tokens-per-micro-batch``):

* packing lays real tokens end to end with positions restarting per sequence, and unpacks back;
* packed log-probs, entropy and their gradients equal the padded forward's (sdpa and eager; a Llama
  attending one packed sequence at a time or under the block-diagonal mask);
* a packed causal LM returns the padded forward's logits on real tokens; a value head runs padded;
* token-budget groups, by hand;
* an RL policy update and the offline objectives (sft, dpo, kto, distill) take the same optimizer
  step packed or padded, in micro-batches of rows or of tokens (the step does not depend on the split).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlhf.core.logprobs import token_logprobs
from rlhf.fastpaths.packing import PackedModel, pack_rows, packing_path, unpack
from rlhf.fastpaths.verdicts import verdict
from rlhf.runtime.step.micro_batches import token_budget_groups
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.workers import PolicyWorker
from rlhf.runtime.step.micro_batches import UpdateSettings
from tests.helpers import MAX_NEW, assert_same_gradients, command_args, make_batch, padded_batch, read_jsonl, run_cli
from tests.runtime.recording import RecordingBackend, recording_plugin


@pytest.mark.unit
def test_pack_rows_and_unpack_by_hand():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0], [1, 2, 3, 4]])  # left-, right- and not padded
    mask = (torch.arange(4)[None, :] >= torch.tensor([[2], [0], [0]])) & \
           (torch.arange(4)[None, :] < torch.tensor([[4], [3], [4]]))
    packed = pack_rows(ids, mask.long())
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2, 3]]
    assert packed.index.tolist() == [[-1, -1, 0, 1], [2, 3, 4, -1], [5, 6, 7, 8]]
    back = unpack(packed.input_ids[..., None].float(), packed.index, fill=-1.0)[..., 0]  # (B, T)
    assert back.tolist() == [[-1, -1, 5, 6], [7, 8, 9, -1], [1, 2, 3, 4]]


@pytest.mark.unit
def test_token_budget_groups_by_hand():
    # padded: rows x longest; 2 x 3 = 6 fits 10, a third of 5 makes 3 x 5 = 15
    assert token_budget_groups([3, 3, 5, 5, 9], 10) == [[0, 1], [2, 3], [4]]
    # packed: the sum of real tokens
    assert token_budget_groups([3, 3, 5, 5, 9], 11, packed=True) == [[0, 1, 2], [3], [4]]
    # items of several rows (a preference pair): 2 rows x 4 = 8, 4 x 4 = 16 > 12, then 3 x 4 = 12
    assert token_budget_groups([4, 4, 2], 12, rows=[2, 2, 1]) == [[0], [1, 2]]
    assert token_budget_groups([], 10) == []
    assert token_budget_groups([50], 10) == [[0]]  # over the budget: alone


@pytest.fixture(params=["sdpa", "eager"])
def lm(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=request.param)


@pytest.mark.unit
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_ones(lm):
    ids, mask, actions = padded_batch()
    padded, padded_entropy = token_logprobs(lm, ids, mask, actions, temperature=0.7, with_entropy=True)
    packed, packed_entropy = token_logprobs(PackedModel(lm), ids, mask, actions, temperature=0.7,
                                            with_entropy=True)
    assert torch.allclose(packed * actions, padded * actions, atol=1e-5)
    assert torch.allclose(packed_entropy * actions, padded_entropy * actions, atol=1e-5)
    assert (packed * (1 - actions)).abs().max() == 0  # nothing off the action mask

    def grads(model):
        lm.zero_grad()
        logprobs, entropy = token_logprobs(model, ids, mask, actions, with_entropy=True)
        ((logprobs + 0.1 * entropy) * actions).sum().backward()
        return {name: p.grad.clone() for name, p in lm.named_parameters()}

    assert_same_gradients(grads(PackedModel(lm)), grads(lm), atol=1e-5)
    assert verdict(lm, packing_path(lm, ids, mask)) is True


@pytest.mark.unit
@pytest.mark.parametrize("pays_from", [0, 10**12])  # attention per sequence always / never
def test_packed_attention_per_sequence_equals_the_padded_forward(tiny_model_dir, monkeypatch, pays_from):
    """A Llama packed row attends one sequence at a time (segment_attention) where that saves scores,
    else under the block-diagonal mask: log-probs, entropy and gradients equal the padded ones either way."""
    from transformers import AutoModelForCausalLM

    import rlhf.fastpaths.packing as packing
    import rlhf.fastpaths.segment_attention as segments

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    monkeypatch.setattr(segments, "SEGMENTS_PAY_FROM", pays_from)
    real, calls = packing.shared_forward_hidden, []
    monkeypatch.setattr(packing, "shared_forward_hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask, actions = padded_batch()

    def run(model):
        lm.zero_grad()
        logprobs, entropy = token_logprobs(model, ids, mask, actions, temperature=0.7, with_entropy=True)
        ((logprobs + 0.1 * entropy) * actions).sum().backward()
        return logprobs * actions, entropy * actions, {name: p.grad.clone() for name, p in lm.named_parameters()}

    padded, packed = run(lm), run(PackedModel(lm))
    assert torch.allclose(packed[0], padded[0], atol=1e-5) and torch.allclose(packed[1], padded[1], atol=1e-5)
    assert_same_gradients(packed[2], padded[2], atol=1e-5)
    path = "packing/segments" if pays_from == 0 else "packing/masked"
    assert packing.packing_path(lm, ids, mask) == path and verdict(lm, path) is True
    assert verdict(lm, "packing/masked" if pays_from == 0 else "packing/segments") is None  # the other: never run
    assert bool(calls) == (pays_from == 0)  # the path taken (the first call's check runs it too)


@pytest.mark.unit
def test_a_packed_forward_that_differs_is_caught_and_the_model_runs_padded(tiny_model_dir, monkeypatch, caplog):
    """A transformers that ignored the packed row's sequence boundaries (attention across the
    packed sequences) would give other log-probs: the first packed call compares, warns, and the
    model's log-probs run padded from then on."""
    from transformers import AutoModelForCausalLM

    import rlhf.fastpaths.packing as packing

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    ids, mask, actions = padded_batch()
    padded, _ = token_logprobs(lm, ids, mask, actions)
    real = packing._packed_logprobs
    calls = []

    def wrong(*args, **kwargs):
        calls.append(1)
        logprobs, entropy = real(*args, **kwargs)
        return logprobs + 0.1, entropy

    monkeypatch.setattr(packing, "_packed_logprobs", wrong)
    packed_model = PackedModel(lm)
    with caplog.at_level("WARNING"):
        first, _ = token_logprobs(packed_model, ids, mask, actions)
        again, _ = token_logprobs(packed_model, ids, mask, actions)
    assert verdict(lm, packing.packing_path(lm, ids, mask)) is False
    assert f"the fast path {packing.packing_path(lm, ids, mask)} differs from the plain path" in caplog.text and len(calls) == 1
    assert torch.equal(first, padded) and torch.equal(again, padded)


@pytest.mark.unit
def test_a_packed_lm_returns_the_padded_logits_and_a_value_head_runs_padded(lm):
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        padded = lm(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        packed = PackedModel(lm)(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        assert packed.shape == padded.shape
        assert torch.allclose(packed * mask[..., None], padded * mask[..., None], atol=1e-5)

    class ValueHead(torch.nn.Module):  # forward(input_ids, attention_mask), no position ids
        def forward(self, input_ids, attention_mask):
            return (input_ids * attention_mask).float()

    wrapped = PackedModel(ValueHead())
    assert not wrapped.packs
    assert torch.equal(wrapped(ids, mask), (ids * mask).float())


def policy_step(model, batch, *, packing, micro_batch_size=8, max_tokens=None):
    from rlhf.algorithms import resolve_algorithm

    RecordingBackend.clear()
    settings = UpdateSettings(train_batch_size=batch.size, micro_batch_size=micro_batch_size,
                              max_new_tokens=MAX_NEW, packing=packing, max_tokens_per_micro_batch=max_tokens)
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0, plugins=build_plugin_manager(load_entrypoints=False))
    worker = PolicyWorker(model, RecordingBackend(model), settings, algo.policy_training_loss(None, entropy_coef=0.05))
    metrics = worker.fit(batch, step=0)
    return RecordingBackend.steps[0], metrics, worker.logprobs(batch)


@pytest.mark.unit
@pytest.mark.parametrize(("packing", "micro", "max_tokens"), [(True, 8, None), (True, 8, 24), (False, 8, 30)])
def test_a_policy_step_is_the_same_packed_and_in_token_budget_micro_batches(tiny_model_dir, packing, micro,
                                                                            max_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = make_batch()
    batch.advantages = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(3)) * \
        batch.action_mask  # (B, A)
    expected, expected_metrics, expected_logprobs = policy_step(copy.deepcopy(model), batch, packing=False,
                                                                micro_batch_size=8)
    got, metrics, logprobs = policy_step(copy.deepcopy(model), batch, packing=packing, micro_batch_size=micro,
                                         max_tokens=max_tokens)
    assert_same_gradients(got, expected, atol=1e-5)
    assert metrics["policy/loss"] == pytest.approx(expected_metrics["policy/loss"], rel=1e-4, abs=1e-6)
    assert metrics["policy/entropy"] == pytest.approx(expected_metrics["policy/entropy"], rel=1e-4)
    mask = batch.action_mask
    assert torch.allclose(logprobs * mask, expected_logprobs * mask, atol=1e-5)


@pytest.mark.run
@pytest.mark.parametrize("command", ["sft", "dpo", "kto", "distill"])
def test_offline_objectives_take_the_same_step_packed_and_by_token_budget(command, tiny_model_dir, fit_data,
                                                                          fit_teacher, tmp_path, monkeypatch):
    """Padded micro-batches of 4 against packed ones of 1 example and packed token-budget ones; DPO's
    pairs keep their shared prompt packed (one row of real tokens a micro-batch)."""
    import rlhf.fastpaths.prefix_sharing as sharing

    forwards = []
    real = sharing.shared_forward_hidden
    monkeypatch.setattr(sharing, "shared_forward_hidden",
                        lambda m, ids, *a: forwards.append(ids.shape[0] == 1 and a[2] is not None) or real(m, ids, *a))
    runs = []
    for extra in ([], ["--packing", "--micro-batch-size", "1"], ["--packing", "--max-tokens-per-micro-batch", "40"]):
        forwards.clear()
        out = tmp_path / f"run{len(runs)}"
        plugins = build_plugin_manager(load_entrypoints=False)
        plugins.register(recording_plugin())
        RecordingBackend.clear()
        args = command_args(command, tiny_model_dir, fit_data, fit_teacher) + [
            "--batch-size", "4", "--micro-batch-size", "4", "--steps", "2", "--lr", "0.1",
            "--backend", "recording", "--out", str(out), "--no-progress"] + extra
        result = run_cli(plugins, args)
        assert result.exit_code == 0, result.output
        runs.append((list(RecordingBackend.steps), read_jsonl(out / "metrics.jsonl")))
        if command == "dpo" and extra:  # packed and shared, policy and reference, every micro-batch
            assert forwards and all(forwards), "DPO's packed pairs did not share their prompt"
    (expected_steps, expected_metrics), *others = runs
    for steps, metrics in others:
        assert len(steps) == len(expected_steps) == 2
        for got, expected in zip(steps, expected_steps):
            assert_same_gradients(got, expected, atol=1e-5)
        for a, b in zip(metrics, expected_metrics):
            assert math.isclose(a["train/loss"], b["train/loss"], rel_tol=1e-4, abs_tol=1e-6)


@pytest.mark.run
def test_a_padded_token_budget_counts_every_row_of_an_example(tiny_model_dir, fit_data, fit_teacher, tmp_path,
                                                             monkeypatch):
    """A DPO example is two rows (chosen, rejected): a padded micro-batch of k examples costs
    2k x its longest row, and stays within --max-tokens-per-micro-batch (one example may exceed it)."""
    from rlhf.plugins.objectives.dpo import DPOObjective

    shapes = []
    collate = DPOObjective.collate
    monkeypatch.setattr(DPOObjective, "collate", lambda self, examples, pad: shapes.append(
        (len(examples), tuple(collate(self, examples, pad)["input_ids"].shape))) or collate(self, examples, pad))
    budget = 60
    args = command_args("dpo", tiny_model_dir, fit_data, fit_teacher) + [
        "--batch-size", "8", "--steps", "1", "--max-tokens-per-micro-batch", str(budget), "--out", str(tmp_path / "run"),
        "--no-progress"]
    result = run_cli(build_plugin_manager(load_entrypoints=False), args)
    assert result.exit_code == 0, result.output
    micro_batches = [(examples, rows * width) for examples, (rows, width) in shapes if examples > 1]
    assert micro_batches and all(tokens <= budget for _, tokens in micro_batches)


@pytest.mark.unit
def test_a_bad_token_budget_is_a_user_error(tiny_model_dir, fit_data, fit_teacher, tmp_path):
    plugins = build_plugin_manager(load_entrypoints=False)
    args = command_args("sft", tiny_model_dir, fit_data, fit_teacher) + ["--max-tokens-per-micro-batch", "0",
                                                                "--out", str(tmp_path / "x")]
    result = run_cli(plugins, args)
    assert result.exit_code != 0 and "--max-tokens-per-micro-batch must be at least 1" in result.output


@pytest.mark.unit
def test_the_train_options_reach_the_policy_and_reference_settings(tiny_model_dir):
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.rl.local import build_reference, update_settings
    from rlhf.runtime.config.train_plan import RunPlan

    plugins = build_plugin_manager(load_entrypoints=False)
    config = TrainConfig(model=str(tiny_model_dir), data=["d"], algo="grpo", kl_coef=0.1, packing=True,
                         max_tokens_per_micro_batch=96)
    plan = RunPlan.make(config, plugins)
    settings = update_settings(plan)
    assert settings.packing and settings.max_tokens_per_micro_batch == 96
    reference = build_reference(plan, plan.choices["model_adapter"].load()(plan.component_config("model_adapter")))
    assert reference.packing and reference.max_tokens == 96
    with pytest.raises(Exception, match="--max-tokens-per-micro-batch must be at least 1"):
        TrainConfig(model="m", data=["d"], max_tokens_per_micro_batch=0).derived()
