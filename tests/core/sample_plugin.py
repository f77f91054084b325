"""A plugin module used by the tests as if it were a built-in."""

import rlhf


def length_reward(completions):
    """Length of each completion, in characters."""
    return [float(len(c)) for c in completions]


@rlhf.hookimpl
def register_rewards(register):
    register("length", length_reward)
