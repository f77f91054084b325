"""rlhf: plugin-first reinforcement learning for language models.

Plugin authors need only ``rlhf.hookimpl`` (the same as ``rlhf.api.hookimpl``) and ``rlhf.api``, the
plugin API, for everything else (docs/plugins.md)::

    import rlhf

    @rlhf.hookimpl
    def register_rewards(register):
        register("says_hello", says_hello)

The commands are functions too, taking the command's options as keyword arguments (docs/python-api.md)::

    from rlhf import train
    result = train(algo="grpo", model="./examples/tiny-model", data="examples/data/train.jsonl",
                   label_key="answer", reward="examples/rewards.py:exact_match", steps=50, out="runs/nb")

They are imported when first used, so ``import rlhf`` stays light.
"""

from typing import Any

from rlhf.core.plugin_host.hookspecs import hookimpl
from rlhf.version import __version__

_COMMANDS = ("train", "sft", "rm", "dpo", "kto", "prm", "distill", "generate", "evaluate")
__all__ = ["hookimpl", "__version__", *_COMMANDS]


def __getattr__(name: str) -> Any:
    if name in _COMMANDS:
        from rlhf.cli import python_api

        return getattr(python_api, name)
    raise AttributeError(f"module 'rlhf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_COMMANDS))
