"""click options generated from config dataclasses, so each option is defined once, where its
field is, and commands share them.

* `config_options(cls)`: one flag per field of a config dataclass (``n_samples`` -> ``--n-samples``),
  with the field's help, type, choices and default; nested option groups flattened with their
  prefix (``RewardOptions.on_error`` -> ``--reward-on-error``);
* `component_options(plugins, slots)`: for every slot (``--backend``, ``--policy-loss``, ...), one
  flag per setting of any registered component of that kind, ``--backend.zero-stage``, typed from
  the config class; the short alias (``--zero-stage``) when the setting has one. They default to
  "unset": the component's own default applies, and a setting the chosen component lacks is an
  error when the run is planned.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import click

from rlhf.cli.params import ComponentParam
from rlhf.core.plugin_host.settings import setting_fields

SLOT_SEPARATOR = "__"  # click parameter name of --backend.zero-stage: backend__zero_stage


@dataclass(frozen=True)
class Flag:
    """One generated option."""

    dest: str  # the click parameter name
    names: tuple[str, ...]  # --long-name (and aliases), without the --no- forms
    hint: Any  # the field's type
    help: str
    default: Any = None
    show_default: bool = False
    multiple: bool = False
    choices: tuple[Any, ...] | None = None
    component: str | None = None  # the kind whose registered names the value must be
    nargs: int | None = None  # a fixed number of numbers after the flag (--filter-range 0 1)

    def option(self) -> Any:
        base = _base_type(self.hint)
        if self.nargs:
            return click.option(*self.names, self.dest, nargs=self.nargs, type=float, default=None,
                                help=self.help)
        if base is bool:
            decls = [f"{name}/--no-{name[2:]}" for name in self.names]
            return click.option(*decls, self.dest, default=self.default, show_default=self.show_default,
                                help=self.help)
        if self.multiple:
            kind = click.Choice([str(c) for c in self.choices]) if self.choices else click.UNPROCESSED
            return click.option(*self.names, self.dest, multiple=True, help=self.help, type=kind)
        if self.component is not None:
            kind: Any = ComponentParam(self.component)
        elif self.choices:
            kind = click.Choice([str(c) for c in self.choices])
        elif typing.get_origin(base) is typing.Literal:
            kind = click.Choice(typing.get_args(base))
        elif base in (int, float):
            kind = base
        elif base is str:
            kind = str
        else:  # tuples, lists, mappings: converted (from text or from a config file) when the run is planned
            kind = click.UNPROCESSED
        return click.option(*self.names, self.dest, type=kind, default=self.default,
                            show_default=self.show_default, help=self.help, metavar=_metavar(base, kind))


def _metavar(base: Any, kind: Any) -> str | None:
    if kind is not click.UNPROCESSED:
        return None
    return "A,B" if typing.get_origin(base) in (tuple, list) or base in (tuple, list) else "VALUE"


def config_value_problem(flag: Flag, value: Any) -> str | None:
    """What is wrong with ``value`` for ``flag`` in a ``--config`` file, as "must be ..." (None: it
    fits). Values click converts from text (a number written as text, ``1e-3``) fit; a list where
    one value goes, a mapping, a word for a number do not. Types converted when the run is planned
    (tuples, mappings) are checked there."""
    if value is None:
        return None
    base = _base_type(flag.hint)
    scalar = (str, int, float, bool)
    if flag.nargs:
        numbers = isinstance(value, list) and all(_is_number(v) for v in value)
        return None if numbers and len(value) == flag.nargs else f"a list of {flag.nargs} numbers"
    if flag.multiple:
        items = value if isinstance(value, list) else [value]
        return None if all(isinstance(v, scalar) for v in items) else "a list of values (text or numbers)"
    if base is bool:
        return None if isinstance(value, bool) else "true or false"
    if base in (int, float) and flag.component is None and not flag.choices:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return "a whole number" if base is int else "a number"
        try:
            number = float(value) if base is float else (int(value) if not isinstance(value, float) else value)
        except ValueError:
            return "a whole number" if base is int else "a number"
        if base is int and isinstance(number, float) and not number.is_integer():
            return "a whole number"
        return None
    if base is str or flag.component is not None or flag.choices or typing.get_origin(base) is typing.Literal:
        return None if isinstance(value, scalar) else "a single value"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _base_type(hint: Any) -> Any:
    """``int | None`` -> int, ``list[str]`` -> list[str]; unions of several types -> Any."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        others = [a for a in typing.get_args(hint) if a is not type(None)]
        return others[0] if len(others) == 1 else Any
    return hint


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


# --- config dataclasses -------------------------------------------------------------------------


def config_flags(config_cls: type, *, nested: Mapping[str, tuple[str, type]] = (), titles: Mapping[str, str] = (),
                 skip: Iterable[str] = ()) -> list[Flag]:
    """One `Flag` per field of ``config_cls`` (fields in ``nested`` expanded with their prefix),
    listed by group in the order of ``titles`` (a config class built from shared option groups
    holds its fields in the order of its base classes)."""
    nested, titles, skip = dict(nested), dict(titles), set(skip)
    hints = typing.get_type_hints(config_cls)
    order = {group: index for index, group in enumerate(titles)}
    fields = sorted(dataclasses.fields(config_cls), key=lambda f: order.get(f.metadata.get("group", ""), len(order)))
    flags = []
    for f in fields:
        if f.name in skip:
            continue
        group = f.metadata.get("group", "")
        if f.name in nested:
            prefix, group_cls = nested[f.name]
            sub_hints = typing.get_type_hints(group_cls)
            flags += [_field_flag(f"{prefix}_{sub.name}", sub, sub_hints[sub.name], titles.get(group, group))
                      for sub in dataclasses.fields(group_cls)]
        else:
            flags.append(_field_flag(f.name, f, hints[f.name], titles.get(group, group)))
    return flags


def _field_flag(name: str, f: dataclasses.Field, hint: Any, title: str) -> Flag:
    meta = f.metadata
    default = None if f.default is dataclasses.MISSING or f.default == "" else f.default
    if _base_type(hint) is bool:
        default = f.default
    return Flag(dest=name, names=(meta.get("flag") or _flag_name(name),), hint=hint,
                help=f"[{title}] {meta.get('help', '')}",
                default=default, show_default=default is not None, multiple=bool(meta.get("multiple")),
                choices=meta.get("choices"), component=meta.get("component"), nargs=meta.get("nargs"))


def nullable_fields(config_cls: type) -> set[str]:
    """Fields whose type admits None (a flag left unset means None for them, not "absent")."""
    hints = typing.get_type_hints(config_cls)
    return {name for name, hint in hints.items() if type(None) in typing.get_args(hint)}


# --- component settings -------------------------------------------------------------------------


def component_flags(plugins: Any, slots: Mapping[str, Any], aliases: Mapping[str, str],
                    default_config: Mapping[str, type] = ()) -> list[Flag]:
    """``--<slot>.<setting>`` for every setting of every registered component of each slot's kind.

    ``slots``: field -> `Slot`; ``aliases``: setting -> slot, the short flags the registered
    components declare (``ConfigBase.short_flags``);
    ``default_config``: slot -> the config class components without one receive (estimators get
    ``AdvantageConfig``). A component whose config class cannot be imported is left out here
    (``rlhf plugins list`` shows why).
    """
    default_config = dict(default_config)
    flags = []
    for slot in slots.values():
        by_field: dict[str, list[tuple[str, dataclasses.Field, Any]]] = {}
        for component in plugins.registry(slot.kind).components():
            try:
                config_cls = component.load_config_cls() or default_config.get(slot.field)
            except Exception:  # noqa: BLE001 - a broken plugin never breaks the command line
                continue
            if config_cls is None:
                continue
            hints = typing.get_type_hints(config_cls)
            for f in setting_fields(config_cls):
                by_field.setdefault(f.name, []).append((component.name, f, hints[f.name]))
        default = default_config.get(slot.field)
        if default is not None:  # the settings every component of the slot has, even with none registered
            hints = typing.get_type_hints(default)
            for f in setting_fields(default):
                by_field.setdefault(f.name, [(f"every {slot.kind.replace('_', ' ')}", f, hints[f.name])])
        for name, owners in by_field.items():
            flags.append(_setting_flag(slot, name, owners, aliases.get(name) == slot.field))
    return flags


def _setting_flag(slot: Any, name: str, owners: list[tuple[str, dataclasses.Field, Any]], alias: bool) -> Flag:
    components = sorted({component for component, _, _ in owners})
    first = owners[0][1]
    hints = {repr(hint) for _, _, hint in owners}
    hint = owners[0][2] if len(hints) == 1 else Any
    defaults = {repr(_default(f)) for _, f, _ in owners}
    default = _default(first)
    shown = f" [default: {default if isinstance(default, str) else repr(default)}]" if len(defaults) == 1 else ""
    names = (f"{slot.flag}.{name.replace('_', '-')}",) + ((_flag_name(name),) if alias else ())
    help_text = f"[{slot.flag[2:]} option of {', '.join(components)}] {first.metadata.get('help', '')}{shown}"
    multiple = typing.get_origin(_base_type(hint)) is list
    return Flag(dest=f"{slot.field}{SLOT_SEPARATOR}{name}", names=names, hint=hint, help=help_text, multiple=multiple,
                nargs=first.metadata.get("nargs"))


def setting_flags(slot: Any, component: str, config_cls: type | None, *, plain: bool) -> list[Flag]:
    """``--<slot>.<setting>`` for each setting of one component's config class, and the plain
    ``--<setting>`` too when ``plain`` (a command dedicated to that component)."""
    if config_cls is None:
        return []
    hints = typing.get_type_hints(config_cls)
    return [_setting_flag(slot, f.name, [(component, f, hints[f.name])], plain) for f in setting_fields(config_cls)]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def split_settings(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pop the set ``<slot>__<setting>`` values out of parsed options into ``{slot: {setting: value}}``."""
    components: dict[str, dict[str, Any]] = {}
    for dest in [k for k in values if SLOT_SEPARATOR in k]:
        value = values.pop(dest)
        if value is None or value == ():
            continue
        slot, _, name = dest.partition(SLOT_SEPARATOR)
        components.setdefault(slot, {})[name] = list(value) if isinstance(value, tuple) else value
    return components
