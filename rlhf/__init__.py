"""rlhf: plugin-first reinforcement learning for language models.

Plugin authors need only ``rlhf.hookimpl`` (the same as ``rlhf.api.hookimpl``) and ``rlhf.api``, the
plugin API, for everything else (docs/plugins.md)::

    import rlhf

    @rlhf.hookimpl
    def register_rewards(register):
        register("says_hello", says_hello)
"""

from rlhf.core.plugin_host.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]
