"""How a trajectory ended: its outcome (docs/outcomes.md). No torch at import time.

Every trajectory ends with exactly one outcome, ``Trajectory.outcome``, and a failure's first line
in ``Trajectory.error``:

- ``ok``: it ended as the policy or the environment chose (EOS, the environment said done).
- ``truncated``: a limit ended it: the token budget, ``--max-new-tokens`` on its last turn, or
  ``--max-turns`` (finish reasons ``length``, ``budget``, ``max_turns``). It trains, under the
  run's overlong and truncation settings.
- ``env_error``: the environment's ``reset`` or ``step`` raised.
- ``reward_error``: a reward source failed on it (``--reward-on-error fail`` or ``skip``).
- ``tool_timeout``: an environment call ran past ``--env-timeout-s``.
- ``agent_error``: the agent driving the trajectory raised (agents, docs/agents.md).
- ``timeout``: the trajectory as a whole ran past its time limit (agents).
- ``stale``: it would break the ``--max-staleness`` bound and was dropped.
- ``drift``: its tokens no longer match what the agent's conversation says (agents).

Only the outcomes of `TRAINED` train. A failed trajectory's reward never enters the loss or its
group's baseline as a number: the run's failure policy (``--on-failure``) retries it, drops its
group or masks it (`rlhf.runtime.rl.failures`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf.core.errors import RlhfError

if TYPE_CHECKING:
    from rlhf.core.types import Trajectory

OK = "ok"
TRUNCATED = "truncated"
ENV_ERROR = "env_error"
REWARD_ERROR = "reward_error"
TOOL_TIMEOUT = "tool_timeout"
AGENT_ERROR = "agent_error"
TIMEOUT = "timeout"
STALE = "stale"
DRIFT = "drift"

# Every outcome with what it means, in the order metrics and reports list them.
OUTCOMES: dict[str, str] = {
    OK: "ended as the policy or the environment chose",
    TRUNCATED: "ended by the token budget, --max-new-tokens or --max-turns",
    ENV_ERROR: "the environment's reset or step raised",
    REWARD_ERROR: "a reward source failed on it",
    TOOL_TIMEOUT: "an environment call ran past --env-timeout-s",
    AGENT_ERROR: "the agent raised",
    TIMEOUT: "the trajectory ran past its time limit",
    STALE: "it would break the --max-staleness bound",
    DRIFT: "its tokens no longer match the agent's conversation",
}
TRAINED = frozenset({OK, TRUNCATED})  # the outcomes that train; every other one is a failure
FAILURES = tuple(name for name in OUTCOMES if name not in TRAINED)
TRUNCATING_FINISHES = frozenset({"length", "budget", "max_turns"})  # finish reasons of a limit


def trains(outcome: str) -> bool:
    """Whether a trajectory with this outcome trains."""
    return outcome in TRAINED


def outcome_of_finish(finish_reason: str) -> str:
    """The outcome of a trajectory that did not fail: ``truncated`` when a limit ended it, else ``ok``."""
    return TRUNCATED if finish_reason in TRUNCATING_FINISHES else OK


def error_line(error: BaseException | str) -> str:
    """A failure's first line: an exception's ``Type: message`` (its message's first line), or a text's."""
    if isinstance(error, BaseException):
        message = str(error).strip()
        first = message.splitlines()[0] if message else ""
        name = type(error).__name__
        if isinstance(error, RlhfError) or first.startswith(name):  # rlhf's own errors speak for themselves
            return first
        return f"{name}: {first}" if first else name
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def fail_trajectory(trajectory: Trajectory, outcome: str, error: BaseException | str) -> Trajectory:
    """Mark ``trajectory`` as ended by the failure ``outcome`` (one of `FAILURES`), with the first
    line of ``error``; returns it."""
    if outcome not in FAILURES:
        raise ValueError(f"{outcome!r} is not a failed outcome; one of {', '.join(FAILURES)}")
    trajectory.outcome, trajectory.error = outcome, error_line(error)
    return trajectory

