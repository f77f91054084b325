"""Labels a reward needs are checked before any model loads: ``rlhf train`` and ``rlhf generate``
with a reward that compares with labels and no ``--label-key`` are refused (they used to run with
every label None: every reward 0, exit 0); ``rlhf score`` reads the ``label`` column that ``rlhf
generate`` writes; an environment that declares ``needs_labels`` is refused likewise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.core.errors import ConfigError
from rlhf.rewards import RewardConfigError
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.config.train_plan import RunPlan
from tests.helpers import run_cli

PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(2)]
REWARDS = '''
def wants_labels(completions, labels):
    return [1.0] * len(completions)

def per_sample(completion, ground_truth):
    return 1.0

def label_optional(completion, label=None):
    return 0.5

def no_labels(completions):
    return [0.0] * len(completions)
'''


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


@pytest.mark.unit
def test_train_with_a_reward_that_compares_with_labels_and_no_label_key_is_refused_before_models_load(
        plugins, files, tmp_path):
    out = tmp_path / "run"
    result = run_cli(plugins, ["train", "--model", str(tmp_path / "no-such-model"), "--data",
                               str(files / "prompts.jsonl"), "--reward", "exact_match", "--out", str(out),
                               "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "reward 'exact_match' compares completions with labels (its 'labels' argument)" in result.output
    assert "pass --label-key COLUMN" in result.output
    assert "Traceback" not in result.output and "no-such-model" not in result.output  # no model was looked for
    assert not out.exists() or not any(out.iterdir())  # nothing written


@pytest.mark.unit
@pytest.mark.parametrize("reward, argument", [("wants_labels", "labels"), ("per_sample", "ground_truth")])
def test_generate_with_a_reward_that_needs_labels_and_no_label_key_is_refused(plugins, files, tmp_path, reward,
                                                                            argument):
    result = run_cli(plugins, ["generate", "--model", str(tmp_path / "no-such-model"), "--data",
                               str(files / "prompts.jsonl"), "--reward", f"{files / 'rewards.py'}:{reward}",
                               "--out", str(tmp_path / "out.jsonl"), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert f"compares completions with labels (its {argument!r} argument)" in result.output
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.unit
def test_sources_that_need_no_labels_or_take_them_optionally_are_not_refused(plugins, files):
    from rlhf.rewards import load_rewards

    rewards = load_rewards([f"{files / 'rewards.py'}:label_optional", f"{files / 'rewards.py'}:no_labels"],
                           plugins=plugins)
    rewards.check_labels_given(None)  # neither needs a label
    rewards = load_rewards([f"{files / 'rewards.py'}:no_labels", "exact_match"], plugins=plugins)
    rewards.check_labels_given("answer")
    with pytest.raises(RewardConfigError, match="reward 'exact_match' compares completions with labels"):
        rewards.check_labels_given(None)


@pytest.mark.run
def test_score_reads_the_label_column_that_generate_writes(plugins, files, tiny_model_dir, tmp_path):
    generated = tmp_path / "generated.jsonl"
    result = run_cli(plugins, ["generate", "--model", str(tiny_model_dir), "--data", str(files / "prompts.jsonl"),
                               "--label-key", "answer", "--n-samples", "2", "--max-new-tokens", "4", "--out",
                               str(generated), "--no-progress"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in generated.read_text().splitlines()]
    assert [row["label"] for row in rows] == [p["answer"] for p in PROMPTS]
    # the labels reach the reward without --label-key: a completion equal to its label scores 1
    for row in rows:
        row["completions"] = [row["label"], row["label"] + "0"]
    generated.write_text("".join(json.dumps(row) + "\n" for row in rows))
    scored = tmp_path / "scored.jsonl"
    result = run_cli(plugins, ["score", "--data", str(generated), "--reward", "exact_match", "--out", str(scored),
                               "--no-progress"])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["rewards"] for line in scored.read_text().splitlines()] == [[1.0, 0.0]] * len(PROMPTS)
    # a file with no label column and no --label-key: refused, nothing written
    (tmp_path / "unlabelled.jsonl").write_text("".join(
        json.dumps({"prompt": row["prompt"], "completions": row["completions"]}) + "\n" for row in rows))
    result = run_cli(plugins, ["score", "--data", str(tmp_path / "unlabelled.jsonl"), "--reward", "exact_match",
                               "--out", str(tmp_path / "refused.jsonl"), "--no-progress"])
    assert result.exit_code == 2 and "pass --label-key COLUMN" in result.output, result.output
    assert not (tmp_path / "refused.jsonl").exists()


class CheckingEnv:
    """An environment that scores answers against the label (declares ``needs_labels``)."""

    needs_labels = True

    def reset(self, prompt, label):
        return None

    def step(self, action_text):
        from rlhf.core.types import StepResult

        return StepResult(reward=1.0, done=True)


@pytest.mark.unit
def test_an_environment_that_needs_labels_is_refused_without_a_label_key(plugins):
    env = "tests.datagen.test_labels:CheckingEnv"
    with pytest.raises(ConfigError, match=r"the '.*CheckingEnv' environment checks answers against labels .* "
                                          r"pass --label-key COLUMN"):
        RunPlan.make(TrainConfig(model="m", data=["d"], env=env), plugins).check(world_size=1)
    RunPlan.make(TrainConfig(model="m", data=["d"], env=env, label_key="answer"), plugins).check(world_size=1)
