"""click parameter types that resolve plugin names and references while parsing, so a typo
is a usage error (exit 2) that lists the valid choices."""

from __future__ import annotations

from typing import Any

import click

from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.kinds import get_kind
from rlhf.core.plugin_host.references import Resolved, resolve


class ComponentParam(click.ParamType):
    """A registered name of one kind, ``module.path:attr`` or ``path/to/file.py:attr``.

    Converts to a `Resolved` (what the user typed, and the object).
    """

    def __init__(self, kind: str, *, default_attr: str | None = None):
        self.kind = get_kind(kind)
        self.default_attr = default_attr
        self.name = f"{self.kind.name.upper()}|module:attr"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Resolved:
        if isinstance(value, Resolved):
            return value
        from rlhf.cli.state import CliState

        state = ctx.find_object(CliState) if ctx is not None else None
        if state is None:
            self.fail("no plugins are loaded (commands must run under the `rlhf` group)", param, ctx)
        try:
            return resolve(value, state.plugins.registry(self.kind), default_attr=self.default_attr)
        except RlhfError as exc:
            self.fail(str(exc), param, ctx)
