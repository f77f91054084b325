"""Built-in plugin: registers the rule-based rewards (``--reward exact_match`` ...).

Imports only the dependency-free reward functions; the reward machinery (HTTP, reward models)
loads when a run uses it.
"""

from __future__ import annotations

from rlhf.api import hookimpl
from rlhf.plugins.rewards.builtin import exact_match, regex_match, think_format
from rlhf.plugins.rewards.math_answer import boxed_math


@hookimpl
def register_rewards(register):
    register("exact_match", exact_match, batched=True, is_async=False)
    register("regex_match", regex_match, batched=False, is_async=False)
    register("think_format", think_format, batched=True, is_async=False)
    register("boxed_math", boxed_math, batched=True, is_async=False)
