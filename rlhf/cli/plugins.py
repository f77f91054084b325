"""``rlhf plugins``: what is installed, from which package, and what is broken."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click

from rlhf.core.errors import close_matches
from rlhf.core.plugin_host.kinds import KINDS
from rlhf.core.plugin_host.loading import PluginRecord, PluginSet
from rlhf.core.plugin_host.registry import Component, normalize_name


@click.group("plugins")
def plugins_group() -> None:
    """Inspect installed plugins and the components they provide."""


@plugins_group.command("list")
@click.option("--all", "show_all", is_flag=True, help="Include built-in plugins")
@click.option("--json", "as_json", is_flag=True, help="Output as JSON (one object per plugin)")
@click.option("--kind", type=click.Choice(sorted(KINDS)), help="Only components of this kind")
@click.pass_obj
def list_command(state: Any, show_all: bool, as_json: bool, kind: str | None) -> None:
    """List plugins and what each provides, per kind.

    Broken plugins are listed last with their error; they never stop this command.
    """
    plugins: PluginSet = state.plugins
    plugins.registries()  # runs the registration hooks, filling each record's `provides`
    records = [r for r in plugins.records if show_all or r.source != "builtin"]
    if kind:
        records = [r for r in records if kind in r.provides]
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records], indent=2))
        return
    if not records:
        click.echo("No plugins installed. Use --all to include built-ins." if not show_all else "No plugins found.")
        return
    _print_table(plugins, records, kind)
    _print_problems(records)


def _print_table(plugins: PluginSet, records: list[PluginRecord], kind: str | None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    shown = set(map(id, records))
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("KIND", "NAME", "PACKAGE", "VERSION", "DESCRIPTION"):
        table.add_column(column, overflow="fold")
    rows: list[tuple[str, ...]] = []
    for registry in plugins.registries().values():
        if kind and registry.kind.name != kind:
            continue
        conflicts = registry.conflicts()
        for component in registry.components():
            record = component.provider
            if id(record) in shown:
                conflict = " [conflict]" if component.name in conflicts else ""
                aliases = ", ".join(a + (" [conflict]" if a in conflicts else "") for a in component.aliases)
                name = component.name + conflict + (f" (alias: {aliases})" if aliases else "")
                rows.append((registry.kind.name, name, record.distribution or "-",
                             record.version or "-", component.description))
    for record in records:
        if record.loaded and not kind:
            if "command" in record.provides:
                for name in record.provides["command"]:
                    rows.append(("command", name, record.distribution or "-", record.version or "-",
                                 f"`rlhf {name}`"))
            events = [h for h in record.hooks if h.startswith("on_")]
            if events:
                rows.append(("hooks", record.name, record.distribution or "-", record.version or "-",
                             ", ".join(events)))
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # plain text: names may contain [brackets]
    if table.row_count:
        Console(width=max(_terminal_width(), 120), soft_wrap=False).print(table)


def _print_problems(records: list[PluginRecord]) -> None:
    failed = [r for r in records if r.status == "error"]
    disabled = [r for r in records if r.status == "disabled"]
    warned = [r for r in records if r.warnings and r.status != "error"]
    if failed:
        click.echo("\nFailed plugins (see `rlhf plugins show NAME` for the traceback):")
        for r in failed:
            click.echo(f"  {r.label}: {r.error}")
    if warned:
        click.echo("\nWarnings:")
        for r in warned:
            for w in r.warnings:
                click.echo(f"  {r.label}: {w}")
    if disabled:
        click.echo("\nDisabled: " + ", ".join(f"{r.label} ({r.error})" for r in disabled))


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((120, 24)).columns


@plugins_group.command("show")
@click.argument("name")
@click.pass_obj
def show_command(state: Any, name: str) -> None:
    """Show one plugin (by plugin or package name) or one component (by its name)."""
    plugins: PluginSet = state.plugins
    registries = plugins.registries()
    records = [r for r in plugins.records if name in (r.name, r.distribution, r.pm_name)]
    key = normalize_name(name)
    components = [c for reg in registries.values() for c in reg.components() if key in (c.name, *c.aliases)]
    if not records and not components:
        known = {r.name for r in plugins.records} | {n for reg in registries.values() for c in reg.components()
                                                     for n in (c.name, *c.aliases)}
        hint = close_matches(name, known)
        raise click.BadParameter(
            f"no plugin or component called {name!r}"
            + (f"; did you mean {' or '.join(repr(h) for h in hint)}?" if hint else ".")
            + " See `rlhf plugins list --all`.",
            param_hint="NAME",
        )
    blocks = [_describe_record(r) for r in records] + [_describe_component(c) for c in components]
    click.echo("\n\n".join(blocks))


def _describe_record(record: PluginRecord) -> str:
    lines = [
        f"plugin {record.name}",
        f"  package:  {record.distribution or '-'} {record.version or ''}".rstrip(),
        f"  source:   {record.source}",
        f"  status:   {record.status}",
        f"  hooks:    {', '.join(record.hooks) or '-'}",
    ]
    for kind, names in sorted(record.provides.items()):
        lines.append(f"  provides: {kind}: {', '.join(sorted(names))}")
    for kind, aliases in sorted(record.aliases.items()):
        lines.append(f"  aliases:  {kind}: " + ", ".join(f"{a} = {n}" for a, n in sorted(aliases.items())))
    if record.error:
        lines.append(f"  error:    {record.error}")
    lines += [f"  warning:  {w}" for w in record.warnings]
    if record.traceback:
        lines.append("  traceback:\n" + "\n".join("    " + line for line in record.traceback.rstrip().splitlines()))
    return "\n".join(lines)


def _describe_component(component: Component) -> str:
    lines = [
        f"{component.kind.name} {component.name}",
        f"  provided by: {component.provider.label}",
        f"  description: {component.description or '-'}",
        f"  selected by: {component.kind.flag} {component.name}"
        + "".join(f", {component.kind.flag} {alias}" for alias in component.aliases) + (
            f", or --{component.capabilities['enabled_by'].replace('_', '-')}"
            if component.capabilities.get("enabled_by") else ""),
    ]
    if component.aliases:
        lines.insert(1, f"  aliases:     {', '.join(component.aliases)} (the same component, logged as "
                        f"{component.name!r})")
    try:
        obj = component.load()
        config_cls = component.load_config_cls()
    except Exception as exc:  # a broken lazy reference is shown, not raised
        lines.append(f"  error:       {exc}")
        return "\n".join(lines)
    where = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    lines.append(f"  object:      {where}")
    flags = {k: v for k, v in component.capabilities.items()}
    if flags:
        lines.append("  flags:       " + ", ".join(f"{k}={_flag_value(v)}" for k, v in sorted(flags.items())))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        lines.append("  settings:    " + ", ".join(f"{f.name}={getattr(obj, f.name)!r}" for f in dataclasses.fields(obj)))
    if config_cls is not None:
        lines.append(f"  config ({config_cls.__name__}):")
        lines += [f"    {line}" for line in describe_config(config_cls, component.kind.flag, component.short_flags)]
    return "\n".join(lines)


def _flag_value(value: Any) -> str:
    """A capability flag as the user reads it: a value, or for a flag that depends on the settings,
    the function that decides it."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"set by the config ({value.__module__}:{value.__qualname__})"
    return repr(value)


def describe_config(config_cls: type, namespace: str | None = None, short_flags: tuple[str, ...] = ()) -> list[str]:
    """One line per dataclass field: name, type, default and help text; then how it is set: its
    flag ``<namespace>.<field>`` (and ``--<field>`` when in ``short_flags``), or the run value it receives."""
    from rlhf.core.plugin_host.settings import RUN_VALUES, run_value_of

    lines = []
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        help_text = f.metadata.get("help", "")
        run = run_value_of(f)
        if run is not None:
            how = f" [set by the run: {RUN_VALUES.get(run, run)}]"
        else:
            short = f", --{f.name.replace('_', '-')}" if f.name in short_flags else ""
            how = f" [{namespace}.{f.name.replace('_', '-')}{short}]" if namespace else ""
        lines.append(f"{f.name} ({kind}, default {default})" + (f": {help_text}" if help_text else "") + how)
    return lines


@plugins_group.command("new")
@click.argument("kind", metavar="KIND")
@click.argument("name")
@click.option("--dir", "directory", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Folder in which the package folder rlhf-NAME is created")
@click.pass_obj
def new_command(state: Any, kind: str, name: str, directory: str) -> None:
    """Write a pip-installable plugin package providing the component NAME of KIND.

    KIND is one of: advantage_estimator, policy_loss, kl_estimator, loss_aggregation, algorithm,
    reward, env, model, rollout_engine, train_backend, objective, sample_filter, reward_shaping. The
    package (rlhf-NAME) has
    pyproject.toml with the rlhf entry point, a documented skeleton that passes `rlhf plugins
    check NAME`, a test and a README. Then: pip install -e DIR/rlhf-NAME.
    """
    from rlhf.plugin_kit.scaffold import check_name, kind_of, new_package, use_command

    taken = sorted({c.provider.label for c in state.plugins.registry(kind_of(kind)).components()
                    if check_name(name) in (c.name, *c.aliases)})  # another plugin's component of that name or alias
    root = new_package(kind, name, directory)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        click.echo(f"wrote {path}")
    key = root.name.removeprefix("rlhf-").replace("-", "_")
    click.echo(f"\nNext:\n  pip install -e {root}\n  rlhf plugins check {key}\n  "
               f"{use_command(kind.lower().replace('-', '_'), key, f'runs/{key}')}")
    if taken:
        title = kind_of(kind).replace("_", " ")
        click.echo(f"\nWarning: {', '.join(taken)} already provides a {title} called {key!r}: once this package is "
                   "installed, both are reported and neither is used. Rename it, or replace the other with "
                   "RLHF_DISABLE_PLUGINS=<its plugin name>.", err=True)


@plugins_group.command("check")
@click.argument("name", required=False)
@click.option("--fixtures", "fixtures_dir", type=click.Path(file_okay=False),
              help="Write the reference fixtures (advantage estimators, policy losses, KL estimators, "
                   "aggregations) as JSON into this directory, for other frameworks to check against")
@click.option("--tolerance", type=float, default=None,
              help="Largest allowed difference to the reference fixtures (relative above 1; default 1e-5)")
@click.pass_obj
def check_command(state: Any, name: str | None, fixtures_dir: str | None, tolerance: float | None) -> None:
    """Run a component's contract on CPU with synthetic inputs; exit 1 when it breaks it.

    Every kind has a contract: estimators, losses and aggregations get synthetic tensors (shapes,
    masks, NaN, micro-batch invariance), rewards a batch of samples, environments a scripted
    episode, adapters, engines, backends and objectives a tiny random model. An estimator, loss,
    KL estimator or aggregation registered with ``implements="grpo"`` (``"ppo"``, ``("cispo",
    "tis")``, ``"k3"``, ``"token_mean"``, ...) is also run on that method's reference fixtures: the
    largest difference is printed, and one beyond the tolerance fails. Also reports how long the
    plugin takes to import (warning above 100 ms). NAME is a component name or, for an
    environment, ``module:Class``.
    """
    from rlhf.plugin_kit.check import NoSuchComponent, run_checks
    from rlhf.plugin_kit.checks import ContractError

    if fixtures_dir is not None:
        from rlhf.algorithms.conformance import export_fixtures

        for path in export_fixtures(fixtures_dir):
            click.echo(f"wrote {path}")
    if name is None:
        if fixtures_dir is None:
            raise click.UsageError("give a component NAME to check, or --fixtures DIR to export the reference fixtures")
        return
    if tolerance is not None and not tolerance > 0:
        raise click.BadParameter(f"must be positive, got {tolerance}", param_hint="--tolerance")
    try:
        for heading, lines in run_checks(name, state.plugins, tolerance=tolerance):
            click.echo(f"{heading}:")
            for line in lines:
                click.echo(f"  {line}")
    except NoSuchComponent as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    except ContractError as exc:
        raise click.ClickException(f"{exc}") from None
