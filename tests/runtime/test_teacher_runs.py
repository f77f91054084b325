"""Runs with a --teacher (on-policy distillation) on the tiny model: with LoRA (a teacher that is the
policy's own base: the first step's reverse KL is exactly 0) and with --async (the behaviour
policy's log-probs as the student's)."""

from __future__ import annotations

import math

import pytest

from tests.helpers import read_jsonl, small_config

pytestmark = pytest.mark.run


def test_opd_with_lora_and_the_base_as_teacher_starts_at_zero(tiny_model_dir, task, tmp_path, plugins):
    """LoRA's adapter starts at zero: the student is its own base, the teacher (the same directory:
    the policy with its adapter switched off), so the first step's reverse KL is exactly 0; the
    rows then add nothing, and the run still trains and ends."""
    from rlhf.runtime.rl.local import train

    config = small_config(tiny_model_dir, task, tmp_path / "out", algo="opd", teacher=str(tiny_model_dir),
                          reward=[], steps=2, components={"model_adapter": {"lora_rank": 4}})
    metrics = read_jsonl(train(config, plugins=plugins) / "metrics.jsonl")
    assert metrics[0]["teacher/reverse_kl"] == 0.0
    assert (tmp_path / "out" / "final").is_dir()


def test_opd_with_async_uses_the_behaviour_policy(tiny_model_dir, fit_teacher, task, tmp_path, plugins):
    from rlhf.runtime.rl.local import train

    config = small_config(tiny_model_dir, task, tmp_path / "out", algo="opd", teacher=str(fit_teacher),
                          teacher_coef=0.5, steps=3, async_rollout=True, max_staleness=1)
    metrics = read_jsonl(train(config, plugins=plugins) / "metrics.jsonl")
    assert len(metrics) == 3
    assert all(m["teacher/reverse_kl"] != 0.0 and math.isfinite(m["teacher/reverse_kl"]) for m in metrics)


def test_the_teacher_is_offloaded_unless_it_is_the_policys_own_base(tiny_model_dir, fit_teacher, task, tmp_path,
                                                                     plugins):
    """--offload-ref-reward moves the teacher off the device between uses, as the reference; a LoRA
    teacher that is the policy's base (the policy with its adapter off) stays, as the policy needs it."""
    from rlhf.runtime.config.train_plan import RunPlan
    from rlhf.runtime.rl.local import build_workers

    for teacher, lora, offloaded in ((fit_teacher, 0, True), (tiny_model_dir, 4, False), (fit_teacher, 0, False)):
        config = small_config(tiny_model_dir, task, tmp_path / "out", algo="opd", teacher=str(teacher),
                              temperature=0.7, offload_ref_reward=offloaded or lora > 0, packing=True,
                              share_prompt=lora > 0, max_tokens_per_micro_batch=64,
                              components={"model_adapter": {"lora_rank": lora}} if lora else {})
        workers, _ = build_workers(RunPlan.make(config, plugins), plugins)
        assert (workers.teacher.away is not None) == offloaded, (teacher, lora)
        assert workers.teacher.temperature == config.temperature  # and micro-batched as the reference is:
        assert (workers.teacher.packing, workers.teacher.share_prompt, workers.teacher.max_tokens) == (True, lora > 0, 64)
