"""What ``--ray-address`` ships to the cluster's workers: the current directory, minus what should stay.

Left out, like Ray does: ``.gitignore`` and ``.rayignore`` patterns (in every directory, relative to
it); and by rlhf: checkouts, environments, earlier runs (`SHIPPING_EXCLUDES`), the run directory
itself, any Ray temp directory inside the folder (a session's files would otherwise zip
themselves), and every ``--ray-exclude PATTERN`` (gitignore syntax). Before Ray zips anything,
`check_size` adds up what is left: over Ray's limit (512 MiB by default) it stops with one line
naming the biggest entries, instead of Ray's traceback after zipping them.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError

# Never shipped with the working directory: checkouts, environments and earlier runs.
SHIPPING_EXCLUDES = [".git", ".venv", "venv", "__pycache__", "*.pyc", "runs", "wandb", ".ray"]
DEFAULT_LIMIT_BYTES = 512 * 1024 * 1024
IGNORE_FILES = (".gitignore", ".rayignore")


def ship_limit_bytes() -> int:
    """Ray's package limit (``RAY_max_grpc_message_size``, 512 MiB unless set)."""
    try:
        from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE

        return int(GCS_STORAGE_MAX_SIZE)
    except (ImportError, AttributeError, ValueError):
        return int(os.environ.get("RAY_max_grpc_message_size", DEFAULT_LIMIT_BYTES))


def _matcher(patterns: list[str]) -> Callable[[str, bool], bool]:
    """gitignore-style matching of a path relative to where the patterns apply."""
    patterns = [p.strip() for p in patterns if p.strip() and not p.strip().startswith("#")]
    try:
        from ray._private.thirdparty.pathspec import PathSpec

        spec = PathSpec.from_lines("gitwildmatch", patterns)
        return lambda rel, is_dir: spec.match_file(rel + "/" if is_dir else rel) or spec.match_file(rel)
    except ImportError:  # without Ray's copy of pathspec: names and simple globs only
        plain = [p.rstrip("/").lstrip("/") for p in patterns if not p.startswith("!")]

        def match(rel: str, is_dir: bool) -> bool:
            parts = rel.split("/")
            return any(fnmatch.fnmatch(rel, p) or any(fnmatch.fnmatch(part, p) for part in parts) for p in plain)

        return match


def _ray_temp_dirs() -> list[Path]:
    roots = [os.environ.get("RAY_TMPDIR"), os.path.join(tempfile.gettempdir(), "ray")]
    return [Path(r).resolve() for r in roots if r]


def runtime_excludes(config: Any, cwd: Path, out_dir: Path) -> list[str]:
    """The ``excludes`` of the job's runtime_env (Ray applies .gitignore/.rayignore itself)."""
    excludes = [*SHIPPING_EXCLUDES, *(getattr(config, "ray_exclude", None) or [])]
    for inside in (out_dir, *_ray_temp_dirs()):
        try:
            excludes.append(str(inside.resolve().relative_to(cwd.resolve())))
        except ValueError:
            pass  # outside the shipped folder
    return excludes


def shipped_files(root: Path, excludes: list[str]) -> Iterator[tuple[str, int]]:
    """(path relative to ``root``, size) of every file that would be shipped; Ray session folders
    found inside are skipped like excluded ones."""
    root = root.resolve()
    base = _matcher(excludes)
    stack: list[tuple[Path, list[tuple[Path, Callable[[str, bool], bool]]]]] = [(root, [(root, base)])]
    while stack:
        directory, matchers = stack.pop()
        local = []
        for name in IGNORE_FILES:
            ignore = directory / name
            if ignore.is_file():
                try:
                    local.append((directory, _matcher(ignore.read_text(errors="replace").splitlines())))
                except OSError:
                    pass
        matchers = matchers + local
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            is_dir = entry.is_dir(follow_symlinks=False)
            if any(m(str(path.relative_to(where)), is_dir) for where, m in matchers):
                continue
            if is_dir:
                if (path / "session_latest").exists():  # a Ray temp dir: it would zip its own session
                    continue
                stack.append((path, matchers))
            elif entry.is_file(follow_symlinks=False):
                try:
                    yield str(path.relative_to(root)), entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue


def check_size(root: Path, excludes: list[str], limit: int | None = None) -> int:
    """The bytes that would be shipped; a `ConfigError` naming the biggest entries over ``limit``."""
    limit = ship_limit_bytes() if limit is None else limit
    total, by_entry = 0, {}
    for rel, size in shipped_files(root, excludes):
        total += size
        top = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
        by_entry[top] = by_entry.get(top, 0) + size
    if total > limit:
        biggest = sorted(by_entry.items(), key=lambda kv: -kv[1])[:5]
        listing = ", ".join(f"{name} {_size(size)}" for name, size in biggest)
        raise ConfigError(f"--ray-address ships the current directory ({root}) to the workers, but it holds "
                          f"{_size(total)} after exclusions, over Ray's {_size(limit)} limit; biggest: {listing}. "
                          "Leave them out with --ray-exclude PATTERN or a .rayignore/.gitignore line, or run from "
                          "a smaller directory (models and data can be read by absolute path or from the hub)")
    return total


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
