"""Which plugins a process runs with, in a form that can be written down and compared.

Every process of a run (the driver, each Ray worker) builds its own plugins from installed
metadata; the runtime records the fingerprint in the run directory and refuses to combine
processes whose fingerprints differ.
"""

from __future__ import annotations

import hashlib
from typing import Any

from rlhf.core.plugin_host.loading import PluginSet


def plugin_fingerprint(plugins: PluginSet) -> dict[str, Any]:
    """``{"plugins": {name: "dist==version"}, "hash": ...}`` over the loaded plugins."""
    entries = {
        record.name: f"{record.distribution or '-'}=={record.version or '-'}"
        for record in plugins.records
        if record.loaded
    }
    entries = dict(sorted(entries.items()))
    digest = hashlib.sha256(repr(sorted(entries.items())).encode()).hexdigest()[:16]
    return {"plugins": entries, "hash": digest}


def fingerprint_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences, one per plugin; empty when the fingerprints agree."""
    want, have = expected["plugins"], actual["plugins"]
    problems = []
    for name in sorted(set(want) | set(have)):
        if name not in have:
            problems.append(f"plugin {name!r} ({want[name]}) is missing")
        elif name not in want:
            problems.append(f"plugin {name!r} ({have[name]}) is extra")
        elif want[name] != have[name]:
            problems.append(f"plugin {name!r} is {have[name]}, expected {want[name]}")
    return problems
