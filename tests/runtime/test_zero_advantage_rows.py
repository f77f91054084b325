"""Rows whose advantages are all zero add nothing to an advantage-weighted loss: the policy update
skips their forwards and takes the same step.

`PolicyTrainingLoss.trained_rows` says which rows can add to the loss (only for losses registered
``advantage_weighted`` with a ``sums_rows`` aggregation and no KL or entropy term), and
`_TrainedWorker._rows_that_train` drops the others (whole groups when prompts are shared) while
the step's counts keep them. The tests compare the recorded gradients and the loss with a run that
trains every row.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.algorithms import resolve_algorithm
from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.runtime.recording import RecordingBackend
from tests.helpers import assert_same_gradients, grouped_batch

pytestmark = pytest.mark.unit


def plugins():
    return build_plugin_manager(load_entrypoints=False)


def training_loss(**overrides):
    entropy_coef = overrides.pop("entropy_coef", 0.0)
    algo = resolve_algorithm("grpo", n_samples=3, plugins=plugins(), **{"kl_coef": 0.0, **overrides})
    return algo.policy_training_loss(None, entropy_coef=entropy_coef)


def idle_batch():
    """`grouped_batch` (4 prompts x 3 samples) with groups 1 and 3 all zero, and one sample of group 0."""
    batch = grouped_batch()
    zero = (batch.group_index == 1) | (batch.group_index == 3)  # (B,)
    zero[0] = True  # row 0: group 0's first sample
    batch.advantages = batch.advantages * (~zero)[:, None]  # (B, A)
    return batch, zero


def test_trained_rows_are_those_with_a_nonzero_advantage_on_a_loss_token():
    batch, zero = idle_batch()
    assert torch.equal(training_loss().trained_rows(batch), ~zero)
    assert torch.equal(training_loss(policy_loss="gspo").trained_rows(batch), ~zero)
    for agg in ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        assert torch.equal(training_loss(loss_agg=agg).trained_rows(batch), ~zero)
    # an advantage outside the loss mask does not make a row train
    batch.advantages[0] = 1.0  # (A,) every position, row 0's action tokens included...
    batch.sample_mask[0] = 0.0  # ...but the sample is dropped (its reward failed): nothing of it is learnt
    assert not bool(training_loss().trained_rows(batch)[0])
    batch.sample_mask[0] = 1.0
    assert bool(training_loss().trained_rows(batch)[0])


def custom_loss(inputs, config):
    """A policy loss registered without ``advantage_weighted``: its rows always train."""
    return -(inputs.logprobs * inputs.advantages) * inputs.loss_mask, {}


def custom_aggregation(loss, loss_mask, norm):
    """An aggregation registered without ``sums_rows``."""
    return (loss * loss_mask).sum() / max(norm.num_tokens, 1)


@pytest.mark.parametrize("overrides", [
    {"entropy_coef": 0.01},  # the entropy term rewards every row
    {"kl_coef": 0.05, "kl_in": "loss"},  # so does the KL term
    {"policy_loss": custom_loss},  # a loss that does not declare it is advantage-weighted
    {"loss_agg": custom_aggregation},  # an aggregation that does not declare it sums rows
])
def test_every_row_trains_unless_the_objective_can_tell(overrides):
    batch, _ = idle_batch()
    assert training_loss(**overrides).trained_rows(batch) is None


def fit(model, batch, *, skip, share, micro_batch_size=4, monkeypatch=None, steps=1):
    from rlhf.algorithms.training_loss import PolicyTrainingLoss
    import rlhf.runtime.rl.workers as workers
    from rlhf.runtime.rl.workers import PolicyWorker
    from rlhf.runtime.step.micro_batches import UpdateSettings

    rows = []
    real = workers.micro_logprobs
    monkeypatch.setattr(workers, "micro_logprobs", lambda m, micro, **kw: rows.append(micro.batch.size) or
                        real(m, micro, **kw))
    if not skip:
        monkeypatch.setattr(PolicyTrainingLoss, "trained_rows", lambda self, batch: None)
    RecordingBackend.clear()
    settings = UpdateSettings(train_batch_size=batch.size, micro_batch_size=micro_batch_size, max_new_tokens=8,
                              share_prompt=share)
    worker = PolicyWorker(model, RecordingBackend(model), settings, training_loss())
    metrics = [worker.fit(batch, step=step) for step in range(steps)]
    monkeypatch.undo()
    return list(RecordingBackend.steps), metrics, sum(rows)


@pytest.mark.parametrize("share", [True, False])
def test_a_step_without_the_zero_advantage_rows_is_the_same_step(tiny_model_dir, monkeypatch, share):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch, zero = idle_batch()
    expected, expected_metrics, all_rows = fit(copy.deepcopy(model), batch, skip=False, share=share,
                                               monkeypatch=monkeypatch)
    got, metrics, trained = fit(copy.deepcopy(model), batch, skip=True, share=share, monkeypatch=monkeypatch)
    assert all_rows == 12 and "policy/zero_advantage_frac" not in expected_metrics[0]
    # shared prompts keep a group whole (row 0 trains with group 0); otherwise each zero row is skipped
    skipped = 6 if share else int(zero.sum())
    assert trained == 12 - skipped
    assert metrics[0]["policy/zero_advantage_frac"] == pytest.approx(skipped / 12)
    assert_same_gradients(got[0], expected[0], atol=1e-5)
    assert metrics[0]["policy/loss"] == pytest.approx(expected_metrics[0]["policy/loss"], rel=1e-5, abs=1e-7)


class NoneGradRecorder(RecordingBackend):
    """Records which parameters reach the optimizer step without a gradient at all."""

    missing: list[list[str]] = []

    def step(self):
        NoneGradRecorder.missing.append([name for name, p in self.params.items() if p.grad is None])
        return super().step()


def test_a_step_where_no_row_trains_still_gives_every_parameter_a_zero_gradient(tiny_model_dir, monkeypatch):
    """Zero gradients and no gradients differ to AdamW (momentum and weight decay act on the first
    only), so with every row idle one row still runs."""
    import rlhf.runtime.rl.workers as workers
    from transformers import AutoModelForCausalLM

    from rlhf.runtime.rl.workers import PolicyWorker

    from rlhf.runtime.step.micro_batches import UpdateSettings

    rows = []
    real = workers.micro_logprobs
    monkeypatch.setattr(workers, "micro_logprobs", lambda m, micro, **kw: rows.append(micro.batch.size) or
                        real(m, micro, **kw))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = grouped_batch()
    batch.advantages = torch.zeros_like(batch.advantages)  # (B, A)
    NoneGradRecorder.missing.clear()
    settings = UpdateSettings(train_batch_size=batch.size, micro_batch_size=4, max_new_tokens=8)
    metrics = PolicyWorker(model, NoneGradRecorder(model), settings, training_loss()).fit(batch, step=0)
    assert sum(rows) == 1
    assert NoneGradRecorder.missing == [[]]
    assert metrics["policy/zero_advantage_frac"] == 1.0 and metrics["policy/loss"] == 0.0
