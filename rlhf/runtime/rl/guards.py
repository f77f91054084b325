"""What stops an RL run early, checked after each step's update: a reward source that failed on
every sample for ``--max-failed-reward-steps`` steps in a row (a step where the rewards abstained,
None, on every sample counts the same: nothing is learned from it either), and a loss that was
non-finite for ``--max-nonfinite-steps`` optimizer steps in a row."""

from __future__ import annotations

from rlhf.core.errors import RlhfError
from rlhf.core.protocols.roles import TrainedRole
from rlhf.runtime.config.train_plan import RunPlan
from rlhf.runtime.rl.events import Events
from rlhf.runtime.step.trained import check_nonfinite_limit


class StepGuards:
    """``trained``: the roles that train, by name (``policy``, ``critic``)."""

    def __init__(self, plan: RunPlan, trained: dict[str, TrainedRole], events: Events):
        self.config, self.trained, self.events = plan.config, trained, events
        self.batch_size = plan.derived.rollout_batch_size
        self.failed_reward_steps = 0  # steps in a row where a reward source failed on every sample

    def check_rewards(self, step: int, metrics: dict[str, float]) -> None:
        """A reward source that failed on every sample teaches nothing, nor do rewards that scored
        no sample at all (None everywhere): say so, and stop after ``--max-failed-reward-steps``
        such steps in a row."""
        failed = sorted(k.removeprefix("reward/failures/") for k, v in metrics.items()
                        if k.startswith("reward/failures/") and v >= self.batch_size)
        what, fix = "failed on", "fix the reward (run with --reward-on-error raise to see its error)"
        if not failed and (silent := abstained(metrics)):  # no source scored a sample: all None
            failed, what = silent, "returned None (abstained) on"
            fix = "make the reward return a number for the samples it should score"
        self.failed_reward_steps = self.failed_reward_steps + 1 if failed else 0
        if not failed:
            return
        config = self.config
        limit = config.max_failed_reward_steps
        if self.failed_reward_steps >= limit:
            raise RlhfError(f"the reward {', '.join(failed)} {what} every sample for {self.failed_reward_steps} "
                            f"steps in a row (--reward-on-error {config.reward_options.on_error}); {fix} "
                            "or raise --max-failed-reward-steps")
        self.events.warn("step %d: the reward %s %s every sample (--reward-on-error %s); the run stops after %d "
                         "such steps in a row", step + 1, ", ".join(failed), what, config.reward_options.on_error,
                         limit)

    def check_finite(self) -> None:
        for name, role in self.trained.items():
            check_nonfinite_limit(role.nonfinite_in_a_row, self.config.max_nonfinite_steps, loss=f"the {name} loss",
                                  check="the rewards")



def abstained(metrics: dict[str, float]) -> list[str]:
    """The reward sources, when none of them scored a sample of the step (no ``reward/<name>`` mean
    logged for any; every round of a filtered step counted); else none."""
    names = sorted(k.removeprefix("reward/failures/") for k in metrics if k.startswith("reward/failures/"))
    return names if names and not any(f"reward/{name}" in metrics for name in names) else []
