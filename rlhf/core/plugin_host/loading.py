"""Find, load and register plugins; fill the registries; keep a record of what happened.

Built-in plugins are the modules in ``DEFAULT_PLUGINS``; third-party plugins are modules named
by entry points in the ``rlhf`` group. Both go through the same ``pm.register``, so built-ins
use exactly the public API. Loading never raises because of a plugin: every failure is kept in
the plugin's `PluginRecord`, shown by ``rlhf plugins list``, and turned into an error only
when a run asks for something the plugin would provide.

Environment: ``RLHF_LOAD_PLUGINS=a,b`` loads only those third-party plugins (``''``: none);
``RLHF_DISABLE_PLUGINS=a,b`` skips plugins, built-ins included. Names are entry-point names,
distribution names or built-in module names.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Iterable, Mapping
from typing import Any

import pluggy

from rlhf.core.plugin_host import hookspecs
from rlhf.core.errors import PluginError, close_matches
from rlhf.core.plugin_host.kinds import KINDS, Kind
from rlhf.core.plugin_host.record import PluginRecord
from rlhf.core.plugin_host.registry import Component, Registry, claimant, make_component

ENTRY_POINT_GROUP = "rlhf"
DISTRIBUTION = "rlhf-core"

# Built-in plugins, registered in this order before any third-party plugin. One module per line.
# Their modules must stay light to import (no torch at import time): register heavy objects by
# "module:attr" reference. tests/core/test_builtins.py checks both rules.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "rlhf.plugins.algorithms.plugin",
    "rlhf.plugins.models.plugin",
    "rlhf.plugins.rewards.plugin",
    "rlhf.plugins.envs.plugin",
    "rlhf.plugins.tool_parsers.plugin",
    "rlhf.plugins.engines.plugin",
    "rlhf.plugins.backends.plugin",
    "rlhf.plugins.loggers.plugin",
    "rlhf.plugins.objectives.plugin",
    "rlhf.plugins.filters.plugin",
    "rlhf.plugins.shaping.plugin",
)


class PluginSet:
    """A plugin manager plus the records and registries built from it.

    Make one with `build_plugin_manager`; nothing is built at import time.
    """

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self.records: list[PluginRecord] = []
        self._registries: dict[str, Registry] | None = None

    # --- loading --------------------------------------------------------------------------

    def register(self, plugin: Any, name: str | None = None, *, source: str = "inline",
                 distribution: str | None = None, version: str | None = None) -> PluginRecord:
        """Register a plugin object (a module, class or instance with hookimpls) in-process."""
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        record = PluginRecord(name=name, distribution=distribution, version=version, source=source,
                              plugin=plugin, pm_name=name if source != "entrypoint" else f"{distribution}:{name}")
        self.records.append(record)
        self._add_to_pm(record)
        self._registries = None
        return record

    def unregister(self, name: str) -> None:
        record = self.record(name)
        if record.pm_name and self.pm.get_plugin(record.pm_name) is not None:
            self.pm.unregister(name=record.pm_name)
        self.records.remove(record)
        self._registries = None

    def _add_to_pm(self, record: PluginRecord) -> None:
        try:
            self.pm.register(record.plugin, name=record.pm_name)
        except Exception as exc:  # pluggy's validation message names the hook and arguments
            record.fail(f"{type(exc).__name__}: {exc}", traceback.format_exc())
            return
        problems, warnings = _check_hooks(self.pm, record.plugin)
        if problems:
            self.pm.unregister(name=record.pm_name)
            record.fail("; ".join(problems))
            return
        record.warnings.extend(warnings)
        record.hooks = sorted({hc.name for hc in self.pm.get_hookcallers(record.plugin) or []})

    # --- queries --------------------------------------------------------------------------

    def record(self, name: str) -> PluginRecord:
        """The record of the plugin called ``name`` (or of the only plugin of distribution ``name``)."""
        for record in self.records:
            if name in (record.name, record.pm_name):
                return record
        by_dist = [r for r in self.records if r.distribution == name and r.source != "builtin"]
        if len(by_dist) == 1:
            return by_dist[0]
        raise KeyError(name)

    @property
    def broken(self) -> list[PluginRecord]:
        return [r for r in self.records if r.status == "error"]

    @property
    def hook(self) -> Any:
        return self.pm.hook

    # --- registries -----------------------------------------------------------------------

    def registry(self, kind: str | Kind) -> Registry:
        """The registry of one kind; the first call runs every plugin's registration hooks."""
        name = kind.name if isinstance(kind, Kind) else kind
        return self.registries()[name]

    def registries(self) -> dict[str, Registry]:
        if self._registries is None:
            self._registries = self._collect()
        return self._registries

    def _collect(self) -> dict[str, Registry]:
        registries = {name: Registry(kind) for name, kind in KINDS.items()}
        for record in self.records:
            record.provides = {k: v for k, v in record.provides.items() if k == "command"}
            record.aliases = {}
            if not record.loaded:
                continue
            try:
                staged = self._call_registration_hooks(record)
            except Exception as exc:
                record.fail(f"{type(exc).__name__}: {exc}", traceback.format_exc())
                continue
            for component in staged:
                for key, other in registries[component.kind.name].add(component):
                    _note_conflict(component, other, key)
                record.provides.setdefault(component.kind.name, []).append(component.name)
                for alias in component.aliases:
                    record.aliases.setdefault(component.kind.name, {})[alias] = component.name
        broken = self.broken
        for registry in registries.values():
            registry._broken = broken
        return registries

    def _call_registration_hooks(self, record: PluginRecord) -> list[Component]:
        """Run one plugin's registration hooks; all or nothing, so a failure leaves no half."""
        staged: list[Component] = []
        for kind in KINDS.values():
            for impl in _impls_of(self.pm, kind.hook, record.plugin):
                if impl.wrapper or impl.hookwrapper:
                    raise PluginError(f"{kind.hook} must not be a wrapper")

                def register(name: Any, obj: Any, _kind: Kind = kind, **metadata: Any) -> None:
                    staged.append(make_component(_kind, record, name, obj, **metadata))

                try:
                    impl.function(**{arg: register for arg in impl.argnames})
                except Exception as exc:
                    raise PluginError(f"{kind.hook} failed: {type(exc).__name__}: {exc}") from exc
        return staged

    # --- commands and events --------------------------------------------------------------

    def add_commands(self, cli: Any) -> None:
        """Let each plugin add click commands; a plugin that fails or clashes is recorded."""
        for record in self.records:
            if not record.loaded:
                continue
            for impl in _impls_of(self.pm, "register_commands", record.plugin):
                before = dict(cli.commands)
                try:
                    impl.function(**{arg: cli for arg in impl.argnames})
                except Exception as exc:
                    cli.commands.clear()
                    cli.commands.update(before)
                    record.fail(f"register_commands failed: {type(exc).__name__}: {exc}", traceback.format_exc())
                    continue
                clashes = [n for n in before if cli.commands.get(n) is not before[n]]
                if clashes:
                    for n in clashes:
                        cli.commands[n] = before[n]
                    record.warnings.append(f"command(s) {', '.join(clashes)} already exist; not replaced")
                added = sorted(set(cli.commands) - set(before))
                if added:
                    record.provides["command"] = sorted(set(record.provides.get("command", [])) | set(added))

    def emit(self, event: str, **kwargs: Any) -> None:
        """Fire a lifecycle event (``on_step_end`` ...) on every plugin, in pluggy's call order.

        An implementation that raises is reported with its plugin's package.
        """
        caller = getattr(self.pm.hook, event)
        for impl in reversed(caller.get_hookimpls()):
            try:
                impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
            except Exception as exc:
                record = next((r for r in self.records if r.pm_name == impl.plugin_name), None)
                who = record.label if record else impl.plugin_name
                raise PluginError(f"plugin {who} failed in {event}: {type(exc).__name__}: {exc}") from exc


def _impls_of(pm: pluggy.PluginManager, hook: str, plugin: Any) -> list[Any]:
    caller = getattr(pm.hook, hook, None)
    if caller is None:
        return []
    return [impl for impl in caller.get_hookimpls() if impl.plugin is plugin]


def _check_hooks(pm: pluggy.PluginManager, plugin: Any) -> tuple[list[str], list[str]]:
    """Unknown hook names (with a close match) are problems; arguments with defaults are warnings."""
    specs = [name for name, obj in vars(hookspecs).items() if hasattr(obj, f"{hookspecs.PROJECT_NAME}_spec")]
    problems, warnings = [], []
    for caller in pm.get_hookcallers(plugin) or []:
        impls = [i for i in caller.get_hookimpls() if i.plugin is plugin]
        if not caller.has_spec():
            if all(i.optionalhook for i in impls):
                continue
            hint = close_matches(caller.name, specs, n=1)
            problems.append(f"unknown hook {caller.name!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""))
            continue
        for impl in impls:
            if impl.kwargnames:
                warnings.append(
                    f"{caller.name}: argument(s) {', '.join(impl.kwargnames)} have defaults, so they are "
                    "never passed; remove the defaults"
                )
    return problems, warnings


def _note_conflict(new: Component, first: Component, key: str) -> None:
    """Two registrations claim ``key``: a name of both, or an alias of one or both."""
    for mine, theirs in ((new, first), (first, new)):
        record = mine.provider
        if record.status == "ok":
            record.status = "conflict"
        if key == mine.name == theirs.name:
            record.warnings.append(
                f"{mine.kind.title} {mine.name!r} is also provided by {theirs.provider.label}; "
                "neither can be used until one is removed or disabled"
            )
            continue
        what = f"{mine.kind.title} {key!r}" + ("" if key == mine.name else f" (alias of {mine.name!r})")
        record.warnings.append(
            f"{what} is also claimed by {claimant(theirs, key)}; neither can be used by that name until one "
            "is removed or disabled"
        )


# --- building ---------------------------------------------------------------------------


def _names_from_env(environ: Mapping[str, str], key: str) -> set[str] | None:
    if key not in environ:
        return None
    return {n.strip() for n in environ[key].split(",") if n.strip()}


def _matches(names: set[str], *candidates: str | None) -> bool:
    return any(c in names for c in candidates if c)


def _entry_points() -> list[Any]:
    try:
        from importlib_metadata import entry_points
    except ImportError:  # pragma: no cover - the backport is a dependency
        from importlib.metadata import entry_points
    return list(entry_points(group=ENTRY_POINT_GROUP))


def build_plugin_manager(*, load_entrypoints: bool = True, builtins: Iterable[str] | None = None,
                         environ: Mapping[str, str] | None = None) -> PluginSet:
    """Build a fresh `PluginSet`: built-ins first, then (optionally) installed entry points."""
    import importlib

    from rlhf.version import __version__

    environ = os.environ if environ is None else environ
    disabled = _names_from_env(environ, "RLHF_DISABLE_PLUGINS") or set()
    allowed = _names_from_env(environ, "RLHF_LOAD_PLUGINS")

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    plugins = PluginSet(pm)

    for module_name in DEFAULT_PLUGINS if builtins is None else builtins:
        record = PluginRecord(name=module_name, distribution=DISTRIBUTION, version=__version__,
                              source="builtin", pm_name=module_name)
        plugins.records.append(record)
        if _matches(disabled, module_name):
            record.status, record.error = "disabled", "disabled by RLHF_DISABLE_PLUGINS"
            continue
        try:
            record.plugin = importlib.import_module(module_name)
        except Exception as exc:
            record.fail(f"{type(exc).__name__}: {exc}", traceback.format_exc())
            continue
        plugins._add_to_pm(record)

    if load_entrypoints:
        _load_entry_points(plugins, allowed, disabled)
    return plugins


_installed: PluginSet | None = None
_installed_lock = threading.Lock()


def installed_plugins(plugins: PluginSet | None = None) -> PluginSet:
    """``plugins``, or the process-wide set of installed plugins, built on first use (never at import).

    For the Python API (``rlhf.algorithms``, ``rlhf.rewards``, ``TrainConfig.from_dict``) when the
    caller passes no set; commands and runs pass their own."""
    global _installed
    if plugins is not None:
        return plugins
    with _installed_lock:
        if _installed is None:
            _installed = build_plugin_manager()
        return _installed


def _load_entry_points(plugins: PluginSet, allowed: set[str] | None, disabled: set[str]) -> None:
    entry_points = _entry_points()
    owners: dict[str, list[str]] = {}
    for ep in entry_points:
        owners.setdefault(ep.name, []).append(_dist_name(ep) or "?")
    for ep in entry_points:
        dist, version = _dist_name(ep), _dist_version(ep)
        record = PluginRecord(name=ep.name, distribution=dist, version=version, source="entrypoint",
                              pm_name=f"{dist}:{ep.name}")
        plugins.records.append(record)
        others = [d for d in owners[ep.name] if d != dist]
        if others:
            record.warnings.append(
                f"entry point name {ep.name!r} is also declared by {', '.join(others)}; "
                "RLHF_LOAD_PLUGINS/RLHF_DISABLE_PLUGINS should name the distribution"
            )
        if allowed is not None and not _matches(allowed, ep.name, dist):
            record.status, record.error = "disabled", "not listed in RLHF_LOAD_PLUGINS"
            continue
        if _matches(disabled, ep.name, dist):
            record.status, record.error = "disabled", "disabled by RLHF_DISABLE_PLUGINS"
            continue
        try:
            record.plugin = ep.load()
        except Exception as exc:
            record.fail(f"{type(exc).__name__}: {exc}", traceback.format_exc())
            continue
        plugins._add_to_pm(record)


def _dist_name(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def _dist_version(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.version if dist is not None else None
