"""On-policy distillation (rlhf/algorithms/distillation.py, ``--teacher``): the per-token advantages
against a hand computation with the teacher's and the student's log-probs computed directly from
their logits, the run's own workers and experience maker in between; a teacher with another
tokenizer refused in one line (exit 2) before any weights load; the option checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf.algorithms.distillation import reverse_kl, teacher_advantages
from tests.helpers import ROOT, make_batch, run_cli, small_config

pytestmark = pytest.mark.unit

QUICKSTART_MODEL = ROOT / "examples" / "tiny-model"


def test_teacher_advantages_by_hand():
    student = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, 0.0]])  # (B, A)
    teacher = torch.tensor([[-1.5, -0.25, -2.0], [-0.3, -1.0, -9.0]])  # (B, A)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # (B, A)
    assert torch.allclose(reverse_kl(student, teacher, mask), torch.tensor([[1.0, -0.75, 0.0], [0.2, -2.0, 0.0]]))
    got = teacher_advantages(student, teacher, mask, coef=0.5)
    assert torch.allclose(got, torch.tensor([[-0.5, 0.375, 0.0], [-0.1, 1.0, 0.0]]))  # −λ·m·(s − t)
    with pytest.raises(ValueError, match="positive"):
        teacher_advantages(student, teacher, mask, coef=0.0)
    with pytest.raises(ValueError, match="one shape"):
        reverse_kl(student, teacher[:, :2], mask)


def direct_logprobs(model_dir: Path, batch, temperature: float) -> torch.Tensor:
    """(B, A) log softmax(z/τ) of each next token, straight from the model's full logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()  # (B, A, V)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * batch.action_mask  # (B, A)


@pytest.mark.parametrize("rewarded", [False, True], ids=["pure", "with_task_rewards"])
def test_per_token_advantages_equal_the_hand_computation(tiny_model_dir, fit_teacher, task, tmp_path, plugins,
                                                         rewarded):
    from rlhf.algorithms import compute_advantages
    from rlhf.runtime.config.train_plan import RunPlan
    from rlhf.runtime.rl.experience import ExperienceMaker
    from rlhf.runtime.rl.local import build_workers

    temperature, coef = 0.7, 0.5
    config = small_config(tiny_model_dir, task, tmp_path / "out", algo="opd", teacher=str(fit_teacher),
                          teacher_coef=coef, temperature=temperature, micro_batch_size=3)
    plan = RunPlan.make(config, plugins)
    assert plan.algorithm.needs_teacher and not plan.algorithm.needs_reference
    workers, plan = build_workers(plan, plugins)
    assert workers.reference is None and workers.teacher is not None
    batch = make_batch()
    if rewarded:
        batch.rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 0.0, 2.0, -1.0])  # (B,)
    batch.advantages = batch.returns = None
    maker = ExperienceMaker(plan.algorithm, plan.advantage_config, n_samples=2, recompute_old=False,
                            teacher_coef=coef)
    made = maker.make(batch, workers.policy, teacher=workers.teacher)

    student = direct_logprobs(tiny_model_dir, batch, temperature)  # (B, A)
    teacher = direct_logprobs(fit_teacher, batch, temperature)  # (B, A)
    assert torch.allclose(made.old_logprobs * batch.action_mask, student, atol=1e-5)
    assert torch.allclose(made.teacher_logprobs * batch.action_mask, teacher, atol=1e-5)
    expected = -coef * (student - teacher) * batch.action_mask  # (B, A) no baseline, no discount
    if rewarded:
        task_advantages, _ = compute_advantages("grpo", rewards=batch.rewards, action_mask=batch.action_mask,
                                                group_size=2)
        assert task_advantages.abs().sum() > 0
        expected = expected + task_advantages
    assert expected.abs().sum() > 0.1  # the two random models disagree: the check has something to check
    assert torch.allclose(made.advantages, expected, atol=1e-5)
    assert torch.equal(made.returns, compute_advantages("grpo", rewards=batch.rewards, action_mask=batch.action_mask,
                                                        group_size=2)[1])  # the teacher's term is no return


def test_the_trainer_passes_the_teacher_coefficient_default_one(tiny_model_dir, fit_teacher, task, tmp_path,
                                                                 plugins):
    from rlhf.runtime.config.train_plan import RunPlan
    from rlhf.runtime.rl.local import build_workers
    from rlhf.runtime.rl.trainer import Trainer

    for given, expected in ((None, 1.0), (0.25, 0.25)):
        config = small_config(tiny_model_dir, task, tmp_path / str(given), algo="opd", teacher=str(fit_teacher),
                              teacher_coef=given)
        workers, plan = build_workers(RunPlan.make(config, plugins), plugins)
        assert Trainer(plan, plugins, workers).experience.teacher_coef == expected


def test_the_step_reports_the_mean_reverse_kl_of_its_loss_tokens():
    from rlhf.runtime.rl.step_metrics import step_metrics

    batch = make_batch()
    batch.sample_mask = torch.tensor([1.0, 1, 1, 1, 1, 1, 0, 0])  # (B,) the last two rows' rewards failed
    generator = torch.Generator().manual_seed(3)
    batch.old_logprobs = -torch.rand(batch.action_mask.shape, generator=generator)  # (B, A)
    batch.teacher_logprobs = -2 * torch.rand(batch.action_mask.shape, generator=generator)  # (B, A)
    trajectories = [type("T", (), {"num_policy_tokens": 3, "finish_reason": "stop", "num_turns": 1, "info": {}})()
                    for _ in range(batch.size)]
    metrics = step_metrics(trajectories, batch, {}, {}, {"step": 1.0})
    mask = batch.action_mask * batch.sample_mask[:, None]  # (B, A)
    expected = float(((batch.old_logprobs - batch.teacher_logprobs) * mask).sum() / mask.sum())
    assert metrics["teacher/reverse_kl"] == pytest.approx(expected, rel=1e-6)
    batch.sample_mask = torch.zeros(batch.size)  # (B,) every reward failed: no loss token, a 0 and not a NaN
    assert step_metrics(trajectories, batch, {}, {}, {"step": 1.0})["teacher/reverse_kl"] == 0.0
    batch.teacher_logprobs = None
    assert "teacher/reverse_kl" not in step_metrics(trajectories, batch, {}, {}, {"step": 1.0})


def test_a_teacher_with_another_tokenizer_is_refused_before_weights_load(tiny_model_dir, task, tmp_path, plugins,
                                                                         monkeypatch):
    """examples/tiny-model (bytes only, 261 tokens) against the test's tiny model (320, with merges)."""
    from rlhf.plugins.models.hf import HFModelAdapter

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the tokenizers were compared")

    monkeypatch.setattr(HFModelAdapter, "load", no_weights)
    result = run_cli(plugins, ["train", "--algo", "opd", "--teacher", str(tiny_model_dir), "--model",
                               str(QUICKSTART_MODEL), "--data", str(task / "data.jsonl"), "--steps", "1",
                               "--n-samples", "2", "--prompts-per-step", "2", "--out", str(tmp_path / "out"),
                               "--no-progress"])
    assert result.exit_code == 2, result.output
    message = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(message) == 1 and "does not share the policy's tokenizer" in message[0], result.output
    assert str(tiny_model_dir) in message[0]


def test_tokenizer_difference_names_what_differs():
    from rlhf.runtime.rl.local import tokenizer_difference

    class Tok:
        def __init__(self, vocab, eos="</s>", specials=("</s>",)):
            self.vocab, self.eos_token, self.bos_token, self.unk_token = vocab, eos, None, None
            self.all_special_tokens = list(specials)

        def get_vocab(self):
            return dict(self.vocab)

    base = {"a": 0, "b": 1, "</s>": 2}
    assert tokenizer_difference(Tok(base), Tok(base)) is None
    assert "'a' is id 0 for the policy, 1" in tokenizer_difference(Tok(base), Tok({"a": 1, "b": 0, "</s>": 2}))
    assert tokenizer_difference(Tok(base), Tok({**base, "c": 3})) == "vocabulary of 3 tokens against 4, 'c' in one only"
    assert "eos_token" in tokenizer_difference(Tok(base), Tok(base, eos="b"))
    assert "special tokens" in tokenizer_difference(Tok(base), Tok(base, specials=("</s>", "b")))


@pytest.mark.parametrize("args, words", [
    (["--algo", "opd"], "--algo opd distils a teacher: pass --teacher"),
    (["--teacher-coef", "0.5"], "--teacher-coef weighs a teacher's advantages, and no --teacher"),
    (["--teacher", "{model}", "--teacher-coef", "0"], "--teacher-coef must be positive"),
    (["--teacher", "/nowhere/teacher"], "--teacher"),
])
def test_teacher_options_are_checked(tiny_model_dir, task, tmp_path, plugins, args, words):
    args = [a.replace("{model}", str(tiny_model_dir)) for a in args]
    result = run_cli(plugins, ["train", *args, "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--reward", str(task / "rewards.py"), "--steps", "1", "--out", str(tmp_path / "o"),
                               "--no-progress"])
    assert result.exit_code == 2, result.output
    assert words in result.output


def test_a_teacher_stands_in_for_a_reward(tiny_model_dir, fit_teacher, task, tmp_path, plugins):
    """--reward is required unless something else gives the signal: the environment, or a teacher."""
    from rlhf.core.errors import ConfigError
    from rlhf.runtime.config.train_plan import RunPlan

    config = small_config(tiny_model_dir, task, tmp_path / "out", reward=[])
    with pytest.raises(ConfigError, match="--reward is required"):
        RunPlan.make(config, plugins).check(world_size=1)
    config = small_config(tiny_model_dir, task, tmp_path / "out", reward=[], algo="opd", teacher=str(fit_teacher))
    RunPlan.make(config, plugins).check(world_size=1)


def test_the_behaviour_policys_logprobs_are_the_students_when_given(tiny_model_dir, fit_teacher, task, tmp_path,
                                                                      plugins):
    """Under --async the batch arrives with the behaviour policy's log-probs: the teacher's term uses
    them as the student's, and the current policy is not asked again."""
    from types import SimpleNamespace

    from rlhf.runtime.config.train_plan import RunPlan
    from rlhf.runtime.rl.experience import ExperienceMaker

    config = small_config(tiny_model_dir, task, tmp_path / "out", algo="opd", teacher=str(fit_teacher),
                          teacher_coef=0.5)
    plan = RunPlan.make(config, plugins)
    batch = make_batch()
    batch.rewards = torch.zeros_like(batch.rewards)  # (B,) pure distillation: no task advantage
    batch.advantages = batch.returns = None
    mask = batch.action_mask.float()  # (B, A)
    behaviour = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(0))  # (B, A)
    teacher_lp = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))  # (B, A)
    batch.old_logprobs = behaviour * mask

    def not_again(_):
        raise AssertionError("the policy was asked for log-probs the batch already holds")

    maker = ExperienceMaker(plan.algorithm, plan.advantage_config, n_samples=2, recompute_old=False,
                            teacher_coef=0.5)
    made = maker.make(batch, SimpleNamespace(logprobs=not_again),
                      teacher=SimpleNamespace(logprobs=lambda _: teacher_lp * mask))
    assert torch.allclose(made.advantages, -0.5 * (behaviour - teacher_lp) * mask, atol=1e-6)
