"""Prefix sharing (rlhf/fastpaths/prefix_sharing.py, ``rlhf dpo --share-prompt``):

* the layout by hand: each group's common prefix once, then its rows' remainders, positions as in
  the rows, a mask that keeps each remainder to the prefix and itself;
* log-probs, entropy and their gradients equal the separate forwards' (sdpa and eager), for a pair
  with a shared prompt, responses that begin alike in a group of three, a row that is a prefix of
  another, a group of one, rows padded on the left and on the right;
* ``rlhf dpo`` takes the same optimizer steps with and without sharing, and a model that does not
  take the mask is caught on the first micro-batch and run unshared.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.core.logprobs import token_logprobs
from rlhf.fastpaths.prefix_sharing import shared_token_logprobs
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.fastpaths.prefix_sharing import common_prefix, share_prefixes
from tests.helpers import (assert_same_gradients, command_args, grouped_batch, read_jsonl, run_cli,
                           shared_batch)
from tests.runtime.recording import RecordingBackend, policy_step, recording_plugin


@pytest.mark.unit
def test_common_prefix_by_hand():
    assert common_prefix([[1, 2, 3], [1, 2, 4, 5]]) == 2
    assert common_prefix([[1, 2], [1, 2, 4]]) == 2  # one row is a prefix of the other
    assert common_prefix([[7, 8, 9]]) == 3  # a group of one: the whole row
    assert common_prefix([[1, 2, 3], [1, 5], [1, 2, 3]]) == 1
    assert common_prefix([[4], [5]]) == 0


@pytest.mark.unit
def test_share_prefixes_lays_out_groups_by_hand():
    ids = torch.tensor([[0, 1, 2, 3, 4],   # left-padded: real 1 2 3 4
                        [1, 2, 5, 0, 0],   # right-padded: real 1 2 5
                        [9, 8, 0, 0, 0]])  # a group of its own
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    rows = share_prefixes(ids, mask, [[0, 1], [2]])
    # group 0: prefix 1 2, then row 0's 3 4, then row 1's 5; group 1: 9 8 and padding
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 5], [9, 8, 0, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    assert rows.index.tolist() == [[-1, 0, 1, 2, 3], [0, 1, 4, -1, -1], [5, 6, -1, -1, -1]]
    t, f = True, False
    assert rows.allowed[0].tolist() == [
        [t, f, f, f, f],   # prefix, causal
        [t, t, f, f, f],
        [t, t, t, f, f],   # row 0's remainder: the prefix and itself
        [t, t, t, t, f],
        [t, t, f, f, t],   # row 1's remainder: the prefix and itself, not row 0's tokens
    ]
    assert rows.allowed[1].tolist() == [
        [t, f, f, f, f],
        [t, t, f, f, f],
        [f, f, t, f, f],   # padding attends itself only (no all-masked row), nothing attends padding
        [f, f, f, t, f],
        [f, f, f, f, t],
    ]


@pytest.fixture(params=["sdpa", "eager"])
def lm(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=request.param)


@pytest.mark.unit
def test_shared_logprobs_entropy_and_gradients_equal_the_separate_ones(lm):
    ids, mask, actions, groups = shared_batch()
    rows = share_prefixes(ids, mask, groups)
    assert rows.input_ids.shape[0] == 4
    assert rows.index[rows.index >= 0].unique().numel() == int(mask.sum()) - 4 - 2 * 6 - 3  # prefixes run once
    plain, plain_entropy = token_logprobs(lm, ids, mask, actions, temperature=0.7, with_entropy=True)
    shared, shared_entropy = shared_token_logprobs(lm, rows, ids, actions, temperature=0.7, with_entropy=True)
    assert torch.allclose(shared * actions, plain * actions, atol=1e-5)
    assert torch.allclose(shared_entropy * actions, plain_entropy * actions, atol=1e-5)
    assert (shared * (1 - actions)).abs().max() == 0  # nothing off the action mask
    assert (plain[actions.bool()] < 0).all()  # every compared value is a real log-prob

    def grads(forward):
        lm.zero_grad()
        logprobs, entropy = forward()
        ((logprobs + 0.1 * entropy) * actions).sum().backward()
        return {name: p.grad.clone() for name, p in lm.named_parameters()}

    expected = grads(lambda: token_logprobs(lm, ids, mask, actions, with_entropy=True))
    got = grads(lambda: shared_token_logprobs(lm, rows, ids, actions, with_entropy=True))
    assert_same_gradients(got, expected, atol=1e-5)


@pytest.mark.unit
def test_the_masked_shared_forward_projects_only_the_positions_it_scores(lm):
    """Under the row's mask (segments do not pay for a batch this small), the model is asked for
    logits at the columns some action needs only (``logits_to_keep``), not at every position."""
    ids, mask, actions, groups = shared_batch()
    rows = share_prefixes(ids, mask, groups)
    calls = []
    handle = lm.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    try:
        shared_token_logprobs(lm, rows, ids, actions)
    finally:
        handle.remove()
    (kwargs,) = calls
    kept = kwargs["logits_to_keep"]
    assert 0 < kept.numel() < rows.input_ids.shape[1]


def dpo_steps(tiny_model_dir, fit_data, fit_teacher, out, extra):
    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(recording_plugin())
    RecordingBackend.steps.clear()
    args = command_args("dpo", tiny_model_dir, fit_data, fit_teacher) + [
        "--batch-size", "4", "--micro-batch-size", "2", "--steps", "2", "--lr", "0.1",
        "--backend", "recording", "--out", str(out), "--no-progress"] + extra
    result = run_cli(plugins, args)
    assert result.exit_code == 0, result.output
    return list(RecordingBackend.steps), read_jsonl(out / "metrics.jsonl"), result.output


def assert_same_steps(got, expected):
    (steps, metrics, _), (expected_steps, expected_metrics, _) = got, expected
    assert len(steps) == len(expected_steps) == 2
    for a, b in zip(steps, expected_steps):
        assert_same_gradients(a, b, atol=1e-5)
    for a, b in zip(metrics, expected_metrics):
        for key in ("train/loss", "train/margin", "train/nll"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), key


@pytest.mark.run
def test_dpo_takes_the_same_steps_with_a_shared_prompt(tiny_model_dir, fit_data, fit_teacher, tmp_path, monkeypatch):
    calls = []
    import rlhf.fastpaths.prefix_sharing as sharing

    import rlhf.api

    real = sharing.share_prefixes
    counting = lambda *a: calls.append(1) or real(*a)  # noqa: E731
    # the objective reads it through rlhf.api, which keeps what it resolved first: patch both, rlhf.api
    # first (its old value is resolved from the home module, which must not be patched yet, or undoing
    # the patch would leave the counting function in rlhf.api for every later test)
    monkeypatch.setattr(rlhf.api, "share_prefixes", counting, raising=False)
    monkeypatch.setattr(sharing, "share_prefixes", counting)
    shared = dpo_steps(tiny_model_dir, fit_data, fit_teacher, tmp_path / "shared", [])
    assert calls, "the default dpo run did not share its prompts"
    calls.clear()
    separate = dpo_steps(tiny_model_dir, fit_data, fit_teacher, tmp_path / "separate", ["--no-share-prompt"])
    assert not calls
    assert_same_steps(shared, separate)


@pytest.mark.run
def test_a_model_that_ignores_the_mask_runs_unshared(tiny_model_dir, fit_data, fit_teacher, tmp_path, monkeypatch,
                                                     caplog):
    import rlhf.fastpaths.prefix_sharing as sharing

    separate = dpo_steps(tiny_model_dir, fit_data, fit_teacher, tmp_path / "separate", ["--no-share-prompt"])
    # a model whose attention reaches across rows: every real token sees every earlier one
    monkeypatch.setattr(sharing, "segment_forward_supported", lambda model: False)  # its own forward, masked
    monkeypatch.setattr(sharing, "attention_mask_4d",
                        lambda model, allowed: torch.ones_like(allowed).tril()[:, None])
    with caplog.at_level("WARNING"):
        broken = dpo_steps(tiny_model_dir, fit_data, fit_teacher, tmp_path / "broken", [])
    assert "differs from the plain path" in caplog.text + broken[2]
    assert_same_steps(broken, separate)


# --- rlhf train: a prompt's samples share its forward ---------------------------------------


@pytest.mark.unit
def test_shared_micro_batches_keep_a_prompts_samples_together_and_only_when_it_pays():
    from rlhf.runtime.step.micro_batches import plan_micro_batches, shared_micro_batches

    batch = grouped_batch()
    planned = shared_micro_batches(batch, 4)
    assert planned is not None
    assert sorted(int(r) for micro in planned for r in micro.rows) == list(range(12))  # every row once
    for micro in planned:
        for group in micro.groups:  # a group: rows of one prompt, all of the micro-batch's rows of that prompt
            assert len({int(micro.batch.group_index[r]) for r in group}) == 1
        assert sorted(r for group in micro.groups for r in group) == list(range(micro.batch.size))
    assert any(len(group) == 3 for micro in planned for group in micro.groups)  # whole groups where they fit
    # one sample per prompt: nothing to share, length-sorted padded micro-batches instead
    single = grouped_batch(samples=1)
    assert shared_micro_batches(single, 2) is None
    assert all(micro.groups is None for micro in plan_micro_batches(single, 2, share=True))
    assert all(micro.groups is None for micro in plan_micro_batches(batch, 4, share=True, packed=True))


@pytest.mark.unit
@pytest.mark.parametrize(("micro", "epochs", "minibatch"), [(4, 1, None), (6, 2, 6), (12, 1, None)])
def test_a_policy_step_is_the_same_with_shared_prompts(tiny_model_dir, monkeypatch, micro, epochs, minibatch):
    import copy

    from transformers import AutoModelForCausalLM

    import rlhf.runtime.rl.workers as workers

    calls = []
    real = workers.share_prefixes
    monkeypatch.setattr(workers, "share_prefixes", lambda *a: calls.append(1) or real(*a))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = grouped_batch()
    expected, expected_metrics, expected_logprobs = policy_step(copy.deepcopy(model), batch, share=False,
                                                                micro_batch_size=micro, ppo_epochs=epochs,
                                                                train_batch_size=minibatch)
    assert not calls
    got, metrics, logprobs = policy_step(copy.deepcopy(model), batch, share=True, micro_batch_size=micro,
                                         ppo_epochs=epochs, train_batch_size=minibatch)
    assert calls, "the prompts were not shared"
    assert len(got) == len(expected) == epochs * (12 // (minibatch or 12))
    for a, b in zip(got, expected):
        assert_same_gradients(a, b, atol=1e-5)
    for key in ("policy/loss", "policy/entropy", "policy/clip_frac"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
    mask = batch.action_mask
    assert torch.allclose(logprobs * mask, expected_logprobs * mask, atol=1e-5)


@pytest.mark.unit
def test_reference_logprobs_are_the_same_with_shared_prompts(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rlhf.runtime.rl.workers import ReferenceWorker

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = grouped_batch()
    shared = ReferenceWorker(model, 4, 0.8, share_prompt=True).logprobs(batch)
    separate = ReferenceWorker(model, 4, 0.8, share_prompt=False).logprobs(batch)
    mask = batch.action_mask
    assert (separate[mask.bool()] < 0).all()
    assert torch.allclose(shared * mask, separate * mask, atol=1e-5)


@pytest.mark.unit
def test_the_policy_s_shared_log_probs_follow_the_sampling_temperature(tiny_model_dir):
    """At a temperature other than 1 the shared forward is taken (its check against the separate
    forwards passes) and gives the separate forwards' log-probs at that temperature."""
    from transformers import AutoModelForCausalLM

    from rlhf.core.logprobs import without_last_token
    from rlhf.fastpaths.prefix_sharing import share_prefixes, sharing_path
    from rlhf.fastpaths.verdicts import verdict
    from rlhf.runtime.rl.workers import micro_logprobs
    from rlhf.runtime.step.micro_batches import MicroBatch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = grouped_batch()
    groups = [[row for row in range(batch.size) if int(batch.group_index[row]) == g] for g in range(4)]
    micro = MicroBatch(rows=torch.arange(batch.size), batch=batch, groups=groups)
    with torch.no_grad():
        shared, _ = micro_logprobs(model, micro, temperature=0.8)
        separate, _ = micro_logprobs(model, MicroBatch(rows=micro.rows, batch=batch), temperature=0.8)
        at_one, _ = micro_logprobs(model, MicroBatch(rows=micro.rows, batch=batch), temperature=1.0)
    rows = share_prefixes(batch.input_ids, without_last_token(batch.attention_mask), groups)
    assert verdict(model, sharing_path(model, rows)) is True, "the shared forward was not taken at temperature 0.8"
    mask = batch.action_mask
    assert torch.allclose(shared * mask, separate * mask, atol=1e-5)
    assert not torch.allclose(separate * mask, at_one * mask, atol=1e-3)  # the temperature matters here


@pytest.mark.unit
def test_a_policy_that_ignores_the_mask_trains_unshared(tiny_model_dir, monkeypatch, caplog):
    import copy

    from transformers import AutoModelForCausalLM

    import rlhf.fastpaths.prefix_sharing as sharing

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = grouped_batch()
    expected, _, expected_logprobs = policy_step(copy.deepcopy(model), batch, share=False)
    monkeypatch.setattr(sharing, "segment_forward_supported", lambda model: False)  # its own forward, masked
    monkeypatch.setattr(sharing, "attention_mask_4d", lambda model, allowed: torch.ones_like(allowed).tril()[:, None])
    with caplog.at_level("WARNING"):
        got, _, logprobs = policy_step(copy.deepcopy(model), batch, share=True)
    assert "train: the fast path prefix_sharing/masked differs from the plain path" in caplog.text
    for a, b in zip(got, expected):
        assert_same_gradients(a, b, atol=1e-5)
    assert torch.allclose(logprobs * batch.action_mask, expected_logprobs * batch.action_mask, atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("share", [True, False])
def test_share_prompt_reaches_the_policy_and_reference_settings(tiny_model_dir, share):
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.rl.local import build_reference, update_settings
    from rlhf.runtime.config.train_plan import RunPlan

    plugins = build_plugin_manager(load_entrypoints=False)
    config = TrainConfig(model=str(tiny_model_dir), data=["d"], algo="grpo", kl_coef=0.1, share_prompt=share)
    plan = RunPlan.make(config, plugins)
    assert update_settings(plan).share_prompt is share
    reference = build_reference(plan, plan.choices["model_adapter"].load()(plan.component_config("model_adapter")))
    assert reference.share_prompt is share
    assert TrainConfig(model="m", data=["d"]).share_prompt is True  # the default
