"""Errors that speak to the user. The CLI prints them without a traceback.

Exit codes: 2 for what the user asked that cannot work (`ConfigError` and its kinds: a bad value,
an unknown name, a reference or data file that cannot be loaded, a reward that needs labels the
data lacks), 1 for failures while running (a reward or plugin that breaks, a NaN limit, a run
directory taken), 130 for a run stopped by Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class RlhfError(Exception):
    """Base class of errors caused by input, configuration or installed plugins."""


class ConfigError(RlhfError):
    """A setting that cannot work as given (a bad value, or options that contradict each other).

    The command line reports it as a usage error (exit 2), like a bad flag value.
    """


class RunInterrupted(RlhfError, KeyboardInterrupt):
    """A run stopped by Ctrl-C or SIGTERM; the message says where it can resume from (exit 130)."""


class UnknownComponentError(ConfigError, LookupError):
    """A name that no plugin registered for a kind. Suggestions come from the names and the
    aliases (``aliases``: the usable ones, alias -> anything); ``available`` lists the names."""

    def __init__(self, kind: str, name: str, available: Iterable[str], hint: str = "",
                 aliases: Iterable[str] = ()):
        self.kind, self.name = kind, name
        self.available, self.aliases = sorted(available), sorted(aliases)
        self.suggestions = close_matches(name, [*self.available, *self.aliases])
        message = f"unknown {kind.replace('_', ' ')} {name!r}."
        if self.suggestions:
            message += f" Did you mean {' or '.join(repr(s) for s in self.suggestions)}?"
        message += f" Available: {', '.join(self.available) or '(none)'}"
        message += f" (aliases: {', '.join(self.aliases)})." if self.aliases else "."
        if hint:
            message += f" {hint}"
        message += " See `rlhf plugins list --all`."
        super().__init__(message)


class ComponentConflictError(ConfigError):
    """Two plugins registered the same name for one kind; neither wins."""

    def __init__(self, kind: str, name: str, providers: list[str]):
        self.kind, self.name, self.providers = kind, name, providers
        lines = "\n".join(f"  - {p}" for p in providers)
        super().__init__(
            f"{kind.replace('_', ' ')} {name!r} is provided by several plugins:\n{lines}\n"
            "Uninstall one, or disable one with RLHF_DISABLE_PLUGINS=<plugin name>."
        )


class PluginError(RlhfError):
    """A plugin could not be loaded or broke while registering, and a run needs it."""


class BadReferenceError(ConfigError):
    """A `module:attr` or `file.py:attr` reference that cannot be loaded."""


def close_matches(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The candidates ``name`` is probably a typo of. Short names share little by chance
    (``k4``/``k3``: half the letters); longer ones must share more (``nosuch`` is not ``torch``)."""
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5 if len(name) <= 3 else 0.6)
