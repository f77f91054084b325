"""The path a reader follows through one training step (tools/step_files.py, docs/architecture.md
"Reading one step"): the formula's file calls the method's components itself, with no wrapper
between them, and the path stays as short as it is."""

import pytest

from tools.step_files import measure


@pytest.fixture(scope="module")
def rl_step():
    return measure("rl")


def test_the_rl_loss_file_calls_its_components_and_the_experience_step_calls_the_estimator(rl_step):
    reading, _, handovers = rl_step
    assert handovers["plugins/algorithms/ppo_loss.py:ppo_policy_loss"] == "algorithms/training_loss.py"
    assert handovers["plugins/algorithms/kl.py:k3"] == "algorithms/training_loss.py"
    assert handovers["plugins/algorithms/aggregation.py:token_mean"] == "algorithms/training_loss.py"
    assert handovers["plugins/algorithms/grpo.py:grpo_advantages"] == "runtime/experience.py"
    assert handovers["plugins/backends/torch_backend.py:step"] == "runtime/trained.py"
    assert handovers["rewards.py:exact_match"] == "rewards/calling.py"
    assert "algorithms/components.py" not in reading and "algorithms/advantages.py" not in reading


def test_the_rl_reading_path_stays_short(rl_step):
    reading, running, _ = rl_step
    assert len(reading) <= 23, reading
    assert set(reading) - {"cli/main.py", "cli/train.py"} <= set(running) | {"runtime/local.py", "runtime/lifecycle.py"}


def test_one_dpo_step_goes_from_the_fit_loop_to_the_objective_and_the_shared_update():
    reading, running, handovers = measure("dpo")
    assert handovers["plugins/objectives/dpo.py:loss"] == "runtime/fit/loop.py"
    assert handovers["plugins/backends/torch_backend.py:step"] == "runtime/trained.py"
    assert "runtime/trained.py" in running and len(reading) <= 8, reading
