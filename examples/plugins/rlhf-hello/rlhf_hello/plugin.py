"""Registers one reward, ``says_hello``, with rlhf.

After ``pip install ./examples/plugins/rlhf-hello``, ``rlhf plugins list`` shows it and
``rlhf train --reward says_hello ...`` can use it.
"""

import rlhf


def says_hello(completions: list[str], **kwargs) -> list[float]:
    """1.0 for a completion that contains the word 'hello', else 0.0."""
    return [1.0 if "hello" in completion.lower() else 0.0 for completion in completions]


@rlhf.hookimpl
def register_rewards(register):
    register("says_hello", says_hello)
