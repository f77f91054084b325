"""`PluginRecord`: what the loader knows about one plugin, good or broken (``rlhf plugins list``).

Every component a registry holds names the record of the plugin that provided it, so the type
sits below both the registries and the loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class PluginRecord:
    """What the loader knows about one plugin, good or broken."""

    name: str  # entry-point name, or module name for built-ins and inline plugins
    distribution: str | None
    version: str | None
    source: str  # "builtin", "entrypoint" or "inline"
    status: str = "ok"  # "ok", "error", "conflict" (shares a component name) or "disabled"
    error: str | None = None
    traceback: str | None = None
    warnings: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    provides: dict[str, list[str]] = field(default_factory=dict)
    aliases: dict[str, dict[str, str]] = field(default_factory=dict)  # kind -> {alias: name}
    plugin: Any = field(default=None, repr=False)  # the module or object given to pluggy
    pm_name: str | None = None

    @property
    def label(self) -> str:
        """How messages name the plugin: package, version and plugin name."""
        if self.distribution:
            return f"{self.distribution} {self.version or '?'} ({self.name})"
        return self.name

    @property
    def loaded(self) -> bool:
        return self.status in ("ok", "conflict")

    def fail(self, message: str, tb: str | None = None) -> None:
        self.status, self.error, self.traceback = "error", message, tb

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "distribution": self.distribution, "version": self.version,
            "source": self.source, "status": self.status, "hooks": sorted(self.hooks),
            "provides": {kind: sorted(names) for kind, names in sorted(self.provides.items())},
            "aliases": {kind: dict(sorted(names.items())) for kind, names in sorted(self.aliases.items())},
            "error": self.error, "warnings": list(self.warnings),
        }
