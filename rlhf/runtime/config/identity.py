"""What a checkpoint records of the run that wrote it, and what ``--resume`` compares with it.

Every checkpoint's ``MANIFEST.json`` carries, beside its files' hashes, the run's *identity*
(`run_identity`): the resolved configuration (its SHA-256 and its values, the options a resume may
change freely left out), the plugin versions, a fingerprint of each local data file (``--data``,
``--eval-data``) and the data cursor (where in the data the run stood). ``--resume`` compares the
identity of the newest checkpoint with the command's (`identity_changes`): an option, a plugin's
version or a data file that changed is refused in one line naming it (exit 2) unless
``--resume-override`` names it (an option by its config key, ``plugins`` for plugin versions,
``data`` for changed data files). A checkpoint written before identities were recorded resumes
with one warning.

A data file's fingerprint (`file_fingerprint`) is its size, its modification time and a SHA-256 of
its content: of the whole file up to `FULL_HASH_BYTES`, of its first and last `EDGE_BYTES` beyond
(a larger file is read only at its ends). A file hashed whole counts as changed when its size or
hash differ (a copy with a new mtime is the same data); one hashed at its ends also when its mtime
differs (a change in its middle would otherwise go unseen). A folder (``save_to_disk``) is
fingerprinted file by file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FULL_HASH_BYTES = 64 << 20  # files up to this size are hashed whole
EDGE_BYTES = 4 << 20  # larger ones: their first and last this many bytes
MAX_FOLDER_FILES = 10_000  # a data folder's files fingerprinted at most
OVERRIDE_PLUGINS, OVERRIDE_DATA = "plugins", "data"  # --resume-override names beyond config keys

_cache: dict[tuple[str, int, int], dict[str, Any]] = {}  # (path, size, mtime) -> fingerprint, per process


def flatten(config: dict[str, Any]) -> dict[str, Any]:
    """``{"lr": .., "components": {"backend": {"zero_stage": 3}}}`` -> ``{"lr": .., "backend.zero_stage": 3}``."""
    flat = {k: v for k, v in config.items() if k != "components"}
    for slot, settings in (config.get("components") or {}).items():
        flat.update({f"{slot}.{name}": value for name, value in (settings or {}).items()})
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in flat.items()}


def file_fingerprint(path: Path) -> dict[str, Any]:
    """``{"bytes", "mtime_ns", "sha256", "hashed": "whole" | "ends"}`` of the file ``path``."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _cache:
        return _cache[key]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if stat.st_size <= FULL_HASH_BYTES:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
            hashed = "whole"
        else:
            digest.update(handle.read(EDGE_BYTES))
            handle.seek(stat.st_size - EDGE_BYTES)
            digest.update(handle.read(EDGE_BYTES))
            hashed = "ends"
    _cache[key] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest(), "hashed": hashed}
    return _cache[key]


def data_fingerprints(paths: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Each local data file among ``paths`` (as given) -> its `file_fingerprint`; a folder ->
    ``{"folder": {relative path: fingerprint}}``. Hub names and paths that do not exist are left out."""
    out: dict[str, dict[str, Any]] = {}
    for spec in paths:
        path = Path(str(spec)).expanduser()
        try:
            if path.is_file():
                out[str(spec)] = file_fingerprint(path)
            elif path.is_dir():
                files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
                out[str(spec)] = {"folder": {file.relative_to(path).as_posix(): file_fingerprint(file)
                                             for file in files[:MAX_FOLDER_FILES]}}
        except OSError:
            continue  # unreadable: the data loader says so in its own words
    return out


def run_identity(config: dict[str, Any], plugins: dict[str, str], free: Iterable[str]) -> dict[str, Any]:
    """The identity of a run with the resolved ``config`` (config.yaml's mapping) and the plugin
    versions ``plugins`` (name -> ``dist==version``); ``free``: the options a resume may change
    freely, left out. The data cursor is added per checkpoint (`with_cursor`)."""
    values = {k: v for k, v in flatten(config).items() if k not in set(free)}
    text = json.dumps(values, sort_keys=True, default=str)
    data = [*(config.get("data") or []), *(config.get("eval_data") or [])]
    return {"config_sha256": hashlib.sha256(text.encode()).hexdigest(), "config": json.loads(text),
            "plugins": dict(plugins), "data": data_fingerprints(data)}


def with_cursor(identity: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """``identity`` with the data cursor of the trainer ``state`` a checkpoint saves (the loader's
    epoch and position, or the examples counted, and the step)."""
    cursor = {key: state[key] for key in ("step", "loader", "num_examples") if key in state}
    return {**identity, "cursor": cursor}


def identity_changes(recorded: dict[str, Any], now: dict[str, Any]) -> dict[str, list[str]]:
    """What differs between the identity a checkpoint ``recorded`` and the run's ``now``: override
    name -> descriptions (config keys, ``plugins``, ``data``); empty when nothing changed."""
    changes: dict[str, list[str]] = {}
    if recorded.get("config_sha256") != now.get("config_sha256"):
        before, after = recorded.get("config") or {}, now.get("config") or {}
        for key in sorted(set(before) | set(after)):
            if before.get(key) != after.get(key):
                changes.setdefault(key, []).append(f"{key}: {_short(before.get(key))} -> {_short(after.get(key))}")
    before_plugins, after_plugins = recorded.get("plugins") or {}, now.get("plugins") or {}
    for name in sorted(set(before_plugins) & set(after_plugins)):  # added or removed plugins: a warning (lifecycle)
        if before_plugins[name] != after_plugins[name]:
            changes.setdefault(OVERRIDE_PLUGINS, []).append(
                f"plugin {name}: {before_plugins[name]} -> {after_plugins[name]}")
    before_data, after_data = recorded.get("data") or {}, now.get("data") or {}
    for name in sorted(set(before_data) & set(after_data)):  # another path: the ``data`` option changed
        for why in _data_changes(name, before_data[name], after_data[name]):
            changes.setdefault(OVERRIDE_DATA, []).append(why)
    return changes


def _data_changes(name: str, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What changed in the data file (or folder) ``name``, in a few words each."""
    if "folder" not in before and "folder" not in after:
        why = _file_change(before, after)
        return [] if why is None else [f"{name} changed ({why})"]
    files_before, files_after = before.get("folder") or {}, after.get("folder") or {}
    out = [f"{name}/{rel} is gone" for rel in sorted(set(files_before) - set(files_after))]
    out += [f"{name}/{rel} is new" for rel in sorted(set(files_after) - set(files_before))]
    for rel in sorted(set(files_before) & set(files_after)):
        why = _file_change(files_before[rel], files_after[rel])
        if why is not None:
            out.append(f"{name}/{rel} changed ({why})")
    return out


def _file_change(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    if before.get("bytes") != after.get("bytes"):
        return f"{before.get('bytes', 0):,} bytes -> {after.get('bytes', 0):,}"
    if before.get("sha256") != after.get("sha256"):
        return "same size, other content: its SHA-256 differs"
    if after.get("hashed") == "ends" and before.get("mtime_ns") != after.get("mtime_ns"):
        return f"modified since; larger than {FULL_HASH_BYTES >> 20} MiB, so only its ends are hashed"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_cursor(cursor: dict[str, Any] | None) -> str:
    """Where the data cursor stood, in a few words (for messages)."""
    if not cursor:
        return "an unrecorded position"
    loader = cursor.get("loader") or {}
    if isinstance(loader, dict) and "position" in loader:
        return f"epoch {loader.get('epoch', 0)}, prompt {loader['position']}"
    return f"step {cursor.get('step', '?')}"
