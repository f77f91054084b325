"""The path a reader follows through one training step (tools/step_files.py, docs/architecture.md
"Reading one step"): the formula's file calls the method's components itself, with no wrapper
between them, the path stays as short as it is, and with the fast paths switched off no code of
theirs runs."""

import pytest

from tools.step_files import measure

pytestmark = pytest.mark.run


@pytest.fixture(scope="module")
def rl_step():
    return measure("rl")


def test_the_rl_loss_file_calls_its_components_and_the_experience_step_calls_the_estimator(rl_step):
    handovers = rl_step.handovers
    assert handovers["plugins/algorithms/policy_losses.py:ppo_policy_loss"] == "algorithms/training_loss.py"
    assert handovers["plugins/algorithms/policy_losses.py:k3"] == "algorithms/training_loss.py"
    assert handovers["plugins/algorithms/policy_losses.py:token_mean"] == "algorithms/training_loss.py"
    assert handovers["plugins/algorithms/grpo.py:grpo_advantages"] == "runtime/rl/experience.py"
    assert handovers["plugins/backends/torch_backend.py:step"] == "runtime/step/trained.py"
    assert handovers["rewards.py:exact_match"] == "rewards/calling.py"
    assert "algorithms/components.py" not in rl_step.reading and "algorithms/advantages.py" not in rl_step.reading


def test_the_rl_reading_path_stays_short(rl_step):
    assert len(rl_step.reading) <= 24, rl_step.reading  # batch making and scoring in files of their own
    update = rl_step.stages["runtime/rl/workers.py:fit"]  # from main() through the policy update to optimizer.step()
    assert len(update) <= 12 and "algorithms/training_loss.py" in update, update
    # the step's four parts (tokens.jsonl's logged rows keep their log-probs from the update's forwards)
    assert set(rl_step.stages) == {"runtime/rl/rollout.py:generate", "runtime/rl/scoring.py:score",
                                   "runtime/rl/experience.py:make", "runtime/rl/workers.py:fit"}
    assert set(rl_step.reading) - {"cli/main.py", "cli/train.py", "runtime/rl/local.py", "runtime/run/lifecycle.py"} \
        <= set(rl_step.running)
    assert "fastpaths/prefix_sharing.py" in rl_step.running  # on by default


def test_one_dpo_step_goes_from_the_fit_loop_to_the_objective_and_the_shared_update():
    dpo = measure("dpo")
    assert dpo.handovers["plugins/objectives/dpo.py:loss"] == "runtime/fit/loop.py"
    assert dpo.handovers["plugins/backends/torch_backend.py:step"] == "runtime/step/trained.py"
    assert "runtime/step/trained.py" in dpo.running and len(dpo.reading) <= 8, dpo.reading


@pytest.mark.parametrize("kind", ["rl", "dpo"])
def test_with_the_fast_paths_off_the_step_runs_none_of_their_code(kind):
    plain = measure(kind, plain=True)
    assert [f for f in plain.running if f.startswith("fastpaths/")] == []
    assert "core/logprobs.py" in plain.running and "runtime/step/trained.py" in plain.running
