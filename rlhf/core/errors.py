"""Errors that speak to the user. The CLI prints them without a traceback.

Exit codes: 2 for what the user asked that cannot work (`ConfigError` and its kinds: a bad value,
an unknown name, a reference or data file that cannot be loaded, a reward that needs labels the
data lacks), 1 for failures while running (a reward or plugin that breaks, a NaN limit, a run
directory taken), 130 for a run stopped by Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import difflib
import errno
import os
from collections.abc import Iterable


class RlhfError(Exception):
    """Base class of errors caused by input, configuration or installed plugins."""


class ConfigError(RlhfError):
    """A setting that cannot work as given (a bad value, or options that contradict each other).

    The command line reports it as a usage error (exit 2), like a bad flag value.
    """


class NoSpaceError(RlhfError):
    """A write that found its device full (`no_space`)."""


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


# --- a full disk ------------------------------------------------------------------------------

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_NO_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded", "StorageFull", "os error 28")


def says_no_space(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is a full device: an ``OSError`` with
    ``ENOSPC``/``EDQUOT``, or a writer's message that says so (safetensors', a remote worker's)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE_ERRNOS:
            return True
        if any(text in str(current) for text in _NO_SPACE_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def size_text(size: int) -> str:
    """Bytes as a reader wants them: ``312 bytes``, ``1.9 MiB``, ``4,210 MiB``, ``0 MiB`` for none."""
    if size == 0:
        return "0 MiB"
    if size < 1 << 16:
        return f"{size:,} bytes"
    if size < 10 << 20:
        return f"{size / (1 << 20):.1f} MiB"
    return f"{size >> 20:,} MiB"


def free_space(path: str | os.PathLike) -> int | None:
    """The bytes free on the device of ``path`` (its nearest existing folder); None where unknown."""
    import shutil
    from pathlib import Path

    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def no_space(path: str | os.PathLike, *, needed: str | None = None, free: int | None = None) -> NoSpaceError:
    """``cannot write PATH: No space left on device (N MiB free there); it needs about M``: one line
    naming what could not be written, the space left there and (``needed``, when known) what the
    write needs."""
    free = free_space(path) if free is None else free
    where = f" ({size_text(free)} free there)" if free is not None else ""
    need = f"; it needs {needed}" if needed else ""
    return NoSpaceError(f"cannot write {path}: No space left on device{where}{need}. Free space there (or choose "
                        "another --out), then rerun the command (training: with --resume)")
