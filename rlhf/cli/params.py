"""click parameter types that check plugin names and references while parsing, so a typo is a
usage error (exit 2) that lists the valid choices, without importing what they name.

Only the cheap part is checked here: a registered name exists, a ``file.py:attr`` file exists. The
object itself is imported when the run is planned (`rlhf.runtime.config.plan.choose`), after the
configuration's own checks, so a wrong ``--lr`` is reported before torch is loaded.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import click

from rlhf.core.errors import BadReferenceError, RlhfError
from rlhf.core.plugin_host.kinds import get_kind
from rlhf.core.plugin_host.references import Resolved, is_reference, resolve


class Named:
    """What a `ComponentParam` converts to: the text as typed (``ref``), whether it names a registered
    component, and the object (``obj``), imported when first read."""

    def __init__(self, ref: str, registered: bool, registry: Any, default_attr: str | None):
        self.ref, self.registered = ref, registered
        self._registry, self._default_attr = registry, default_attr

    @property
    def obj(self) -> Any:
        return resolve(self.ref, self._registry, default_attr=self._default_attr).obj

    def __repr__(self) -> str:
        return f"Named({self.ref!r})"


class ComponentParam(click.ParamType):
    """A registered name of one kind, ``module.path:attr`` or ``path/to/file.py:attr``.

    Converts to a `Named` (what the user typed; the object on demand).
    """

    def __init__(self, kind: str, *, default_attr: str | None = None):
        self.kind = get_kind(kind)
        self.default_attr = default_attr
        self.name = f"{self.kind.name.upper()}|module:attr"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Named:
        if isinstance(value, Named):
            return value
        if isinstance(value, Resolved):
            value = value.ref
        from rlhf.cli.state import CliState

        state = ctx.find_object(CliState) if ctx is not None else None
        if state is None:
            self.fail("no plugins are loaded (commands must run under the `rlhf` group)", param, ctx)
        text = str(value)
        registry = state.plugins.registry(self.kind)
        try:
            check_reference(text, registry, default_attr=self.default_attr)
        except RlhfError as exc:
            self.fail(str(exc), param, ctx)
        return Named(text, not is_reference(text), registry, self.default_attr)


def check_reference(text: str, registry: Any, *, default_attr: str | None = None) -> None:
    """What `rlhf.core.plugin_host.references.resolve` would refuse, found without importing what
    ``text`` names: an unknown or conflicting registered name, a reference with no attribute or no
    module, a file that is not there, a module whose top-level package is not installed."""
    if not is_reference(text):
        registry.component(text)  # UnknownComponentError (with close matches), ComponentConflictError
        return
    target, _, attr = text.rpartition(":") if ":" in text else (text, "", "")
    if not (attr or default_attr):
        raise BadReferenceError(f"{text!r} names no attribute: write it as '{text}:NAME'")
    if not target:
        raise BadReferenceError(f"{text!r} names no module: write it as 'module.path:{attr}'")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        try:
            found = path.is_file()
        except OSError:
            found = False
        if not found:
            raise BadReferenceError(f"file {target!r} does not exist (looked at {path.absolute()})")
        return
    top = target.partition(".")[0]
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.append(cwd)  # as `references._load_module` imports: modules of the current directory too
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise BadReferenceError(f"cannot import module {target!r}: No module named {top!r}. Is its package "
                                "installed in this environment?")
