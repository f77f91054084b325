"""Typed registries: one per component kind, filled by the registration hooks.

A registry maps a name to a `Component` that remembers which plugin provided it. A component may
also answer to aliases (``register(..., aliases=("reinforce",))``): other names that look up the
same component, which keeps its own name in logs and checkpoints. A name or alias claimed by two
registrations is kept as a conflict: looking it up is an error that names both providers, and
neither wins; the components' other names still work. Objects given as ``"module:attr"`` strings
are imported on first lookup.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhf.core.errors import ComponentConflictError, PluginError, UnknownComponentError
from rlhf.core.plugin_host.kinds import Kind
from rlhf.core.plugin_host.settings import check_config_cls, setting_fields

if TYPE_CHECKING:
    from rlhf.core.plugin_host.record import PluginRecord

_NAME = re.compile(r"^[a-z0-9][a-z0-9_.]*$")
_UNLOADED = object()


def normalize_name(name: str) -> str:
    """Names are case-insensitive and treat ``-`` and ``_`` alike: ``Dr-GRPO`` is ``dr_grpo``."""
    return name.strip().lower().replace("-", "_")


@dataclass(eq=False)
class Component:
    kind: Kind
    name: str
    target: Any  # the registered object, or a "module:attr" string imported on first use
    provider: PluginRecord
    description: str = ""
    config_cls: Any = None  # a dataclass type, or a "module:attr" string
    capabilities: dict[str, Any] = field(default_factory=dict)
    short_flags: tuple[str, ...] = ()  # settings that also get a plain flag (--zero-stage besides --backend.zero-stage)
    aliases: tuple[str, ...] = ()  # other names that look this component up (normalised)
    _obj: Any = field(default=_UNLOADED, repr=False)

    @property
    def is_lazy(self) -> bool:
        return isinstance(self.target, str)

    def load(self) -> Any:
        """The registered object, imported now if it was registered by reference."""
        if self._obj is _UNLOADED:
            obj = self.target
            if self.is_lazy:
                obj = self._import(self.target, "")
            problem = self.kind.problem(obj, self.capabilities)
            if problem:
                raise PluginError(
                    f"{self.kind.title} {self.name!r} from {self.provider.label} should be "
                    f"{problem}, got {type(obj).__name__}"
                )
            self._obj = obj
        return self._obj

    def load_config_cls(self) -> type | None:
        if isinstance(self.config_cls, str):
            config_cls = self._import(self.config_cls, " (config_cls)")
            problem = check_config_cls(config_cls)
            if problem:
                raise PluginError(f"{self.kind.title} {self.name!r} from {self.provider.label}: config_cls "
                                  f"{self.config_cls!r} should be {problem}")
            problem = unknown_settings(self.kind, config_cls, self.short_flags, self.capabilities)
            if problem:
                raise PluginError(f"{self.kind.title} {self.name!r} from {self.provider.label}: {problem} of "
                                  f"{self.config_cls!r}")
            self.config_cls = config_cls
        return self.config_cls

    def _import(self, ref: str, what: str) -> Any:
        from rlhf.core.plugin_host.references import import_object

        try:
            return import_object(ref)
        except Exception as exc:
            raise PluginError(
                f"{self.kind.title} {self.name!r}{what} from {self.provider.label} could not be "
                f"imported from {ref!r}: {type(exc).__name__}: {exc}"
            ) from exc


def make_component(kind: Kind, provider: PluginRecord, name: Any, obj: Any, *,
                   description: str | None = None, config_cls: Any = None, short_flags: Any = (),
                   aliases: Any = (), **capabilities: Any) -> Component:
    """Validate one ``register(...)`` call and build its component. Raises TypeError/ValueError."""
    if not isinstance(name, str) or not _NAME.match(normalize_name(name)):
        raise ValueError(
            f"invalid {kind.title} name {name!r}: use letters, digits, '_', '-' and '.' "
            "(no ':' or '/', which mark references)"
        )
    aliases = _check_aliases(kind, normalize_name(name), aliases)
    unknown = set(capabilities) - set(kind.capabilities)
    if unknown:
        allowed = ", ".join(sorted(kind.capabilities)) or "none"
        raise TypeError(
            f"register() got unknown flag(s) {', '.join(sorted(unknown))} for {kind.title} "
            f"{name!r}; allowed for this kind: description, config_cls, short_flags, aliases, {allowed}"
        )
    short_flags = (short_flags,) if isinstance(short_flags, str) else tuple(short_flags)
    if short_flags and config_cls is None:
        raise TypeError(f"{kind.title} {name!r}: short_flags name settings of a config_cls; it has none")
    capabilities = {**kind.capabilities, **capabilities}
    named = [flag for flag in kind.setting_capabilities if capabilities[flag] is not None]
    if named and config_cls is None:
        raise TypeError(f"{kind.title} {name!r}: {', '.join(named)} name settings of a config_cls; it has none")
    bad = [flag for flag in short_flags if not (isinstance(flag, str) and flag.isidentifier())]
    if bad:
        raise ValueError(f"{kind.title} {name!r}: short_flags must be setting names (identifiers), got {bad!r}")
    if isinstance(obj, str):
        if ":" not in obj:
            raise ValueError(f"{kind.title} {name!r}: a lazy reference must read 'module.path:attr', got {obj!r}")
    else:
        problem = kind.problem(obj, capabilities)
        if problem:
            raise TypeError(f"{kind.title} {name!r} should be {problem}, got {type(obj).__name__}")
    if isinstance(config_cls, str):
        if ":" not in config_cls:
            raise ValueError(f"{kind.title} {name!r}: a lazy config_cls must read 'module.path:attr', got "
                             f"{config_cls!r}")
    elif config_cls is not None:
        problem = check_config_cls(config_cls)
        if problem:
            raise TypeError(f"{kind.title} {name!r}: config_cls should be {problem}, got {config_cls!r}")
        problem = unknown_settings(kind, config_cls, short_flags, capabilities)
        if problem:
            raise ValueError(f"{kind.title} {name!r}: {problem} of {config_cls.__name__}")
    if description is None:
        description = "" if isinstance(obj, str) else _first_doc_line(obj)
    return Component(
        kind=kind, name=normalize_name(name), target=obj, provider=provider,
        description=description, config_cls=config_cls,
        capabilities=capabilities, short_flags=short_flags, aliases=aliases,
        _obj=_UNLOADED if isinstance(obj, str) else obj,
    )


def unknown_settings(kind: Kind, config_cls: type, short_flags: tuple[str, ...],
                     capabilities: dict[str, Any]) -> str | None:
    """The short flags and setting-naming capabilities (`Kind.setting_capabilities`) of one
    registration that name no setting of ``config_cls``, said for a message; None when all do."""
    settings = {f.name for f in setting_fields(config_cls)}
    unknown = [name for name in short_flags if name not in settings]
    if unknown:
        return f"short_flags {', '.join(unknown)} are not settings"
    named = {flag: capabilities[flag] for flag in kind.setting_capabilities if capabilities.get(flag) is not None}
    wrong = [f"{flag}={value!r}" for flag, value in named.items() if value not in settings]
    return f"{', '.join(wrong)} {'names no setting' if len(wrong) == 1 else 'name no settings'}" if wrong else None


def declared_registration(kind: Kind, obj: Any, ref: str) -> tuple[Any, dict[str, Any]]:
    """``(config_cls, capabilities)`` of an object used by reference (``ref``, ``module:attr``) with
    no registration: what it declares under ``config_cls`` and the kind's flag names (class
    attributes, or attributes of a function) stands for the ``register(...)`` arguments, the kind's
    defaults where it declares none. Read once, where the reference is resolved, and checked as a
    registration is (the protocols its flags promise, the settings they name); the caller has
    checked the object against the kind. Raises `PluginError`."""
    from rlhf.core.plugin_host.contracts import declared

    config_cls = declared(obj, "config_cls")
    capabilities = {flag: declared(obj, flag, default) for flag, default in kind.capabilities.items()}
    problem = kind.broken_promise(obj, capabilities)
    if problem:
        raise PluginError(f"{kind.title} {ref!r} should be {problem}")
    named = [flag for flag in kind.setting_capabilities if capabilities[flag] is not None]
    if config_cls is None and named:
        raise PluginError(f"{kind.title} {ref!r}: {', '.join(named)} name settings of a config_cls; it declares none")
    if config_cls is not None:
        problem = check_config_cls(config_cls)
        if problem:
            raise PluginError(f"{kind.title} {ref!r}: config_cls should be {problem}, got {config_cls!r}")
        problem = unknown_settings(kind, config_cls, (), capabilities)
        if problem:
            raise PluginError(f"{kind.title} {ref!r}: {problem} of {config_cls.__name__}")
    return config_cls, capabilities


def _check_aliases(kind: Kind, name: str, aliases: Any) -> tuple[str, ...]:
    """The normalised aliases of one registration: valid names, none its own name, no repeats."""
    aliases = (aliases,) if isinstance(aliases, str) else tuple(aliases)
    out: list[str] = []
    for alias in aliases:
        if not isinstance(alias, str) or not _NAME.match(normalize_name(alias)):
            raise ValueError(f"invalid alias {alias!r} of {kind.title} {name!r}: use letters, digits, '_', '-' and '.'")
        key = normalize_name(alias)
        if key == name or key in out:
            raise ValueError(f"{kind.title} {name!r}: alias {alias!r} repeats "
                             + ("its name" if key == name else "another alias"))
        out.append(key)
    return tuple(out)


def _first_doc_line(obj: Any) -> str:
    from rlhf.core.plugin_host.contracts import declared

    own = declared(obj, "description")  # presets and similar objects describe themselves
    if isinstance(own, str) and own:
        return own
    doc = (inspect.getdoc(obj) or "").strip()
    return doc.splitlines()[0].strip() if doc else ""


class Registry:
    """All components of one kind. Lookups speak to the user; nothing is silently replaced.

    Every name and alias is a key; a key claimed by two registrations is a conflict, usable by
    neither until one plugin is removed or disabled.
    """

    def __init__(self, kind: Kind, broken: list[PluginRecord] | None = None):
        self.kind = kind
        self._components: dict[str, Component] = {}  # usable names
        self._aliases: dict[str, Component] = {}  # usable aliases
        self._conflicts: dict[str, list[Component]] = {}  # key -> every registration claiming it
        self._broken = broken if broken is not None else []

    def add(self, component: Component) -> list[tuple[str, Component]]:
        """Add a component; return ``(key, first claimant)`` for each of its names and aliases
        that another registration claimed already."""
        clashes = []
        for key in (component.name, *component.aliases):
            if key in self._conflicts:
                clashes.append((key, self._conflicts[key][0]))
                self._conflicts[key].append(component)
                continue
            first = self._components.pop(key, None) or self._aliases.pop(key, None)
            if first is not None:
                self._conflicts[key] = [first, component]
                clashes.append((key, first))
                continue
            (self._components if key == component.name else self._aliases)[key] = component
        return clashes

    def __contains__(self, name: str) -> bool:
        key = normalize_name(name)
        return key in self._components or key in self._aliases

    def __len__(self) -> int:
        return len(self._components)

    def names(self) -> list[str]:
        """Usable names (conflicting ones excluded, aliases not included), sorted."""
        return sorted(self._components)

    def aliases(self) -> dict[str, str]:
        """Usable aliases and the name each stands for, sorted by alias."""
        return {alias: self._aliases[alias].name for alias in sorted(self._aliases)}

    def components(self) -> list[Component]:
        """Every registration, conflicting ones included, once each, sorted by name."""
        everything = {id(c): c for c in (*self._components.values(), *self._aliases.values())}
        for group in self._conflicts.values():
            everything.update((id(c), c) for c in group)
        return sorted(everything.values(), key=lambda c: (c.name, c.provider.label))

    def conflicts(self) -> dict[str, list[Component]]:
        """Each name or alias claimed more than once, and every registration claiming it."""
        return dict(self._conflicts)

    def component(self, name: str) -> Component:
        """The component called ``name`` or with the alias ``name``."""
        key = normalize_name(name)
        if key in self._components:
            return self._components[key]
        if key in self._aliases:
            return self._aliases[key]
        if key in self._conflicts:
            raise ComponentConflictError(self.kind.name, key, [claimant(c, key) for c in self._conflicts[key]])
        hint = ""
        if self._broken:
            labels = ", ".join(f"{r.label} ({r.error})" for r in self._broken)
            hint = f"These plugins failed to load and may provide it: {labels}."
        raise UnknownComponentError(self.kind.name, name, self._components, hint, aliases=self._aliases)

    def get(self, name: str) -> Any:
        """The object registered under ``name`` (imported now if registered by reference)."""
        return self.component(name).load()


def claimant(component: Component, key: str) -> str:
    """Who claims ``key``, for messages: the plugin, and which component when ``key`` is its alias."""
    if key == component.name:
        return component.provider.label
    return f"{component.provider.label}, as an alias of {component.name!r}"
