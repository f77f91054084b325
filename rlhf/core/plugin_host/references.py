"""Turn what a user typed into an object: a registered name, ``module.path:attr`` or
``path/to/file.py:attr`` (console-script syntax), so a function can be tried before it is
packaged as a plugin.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlhf.core.errors import BadReferenceError, close_matches



class Registered(Protocol):
    """Where plain names are looked up: a registry (`rlhf.core.plugin_host.registry.Registry`)."""

    def component(self, name: str) -> Any: ...


@dataclass(frozen=True)
class Resolved:
    """A user reference and the object it names."""

    ref: str  # what the user typed
    obj: Any
    registered: bool  # True when it named a registered component


def is_reference(text: str) -> bool:
    """True for ``module:attr``, ``file.py`` and ``file.py:attr``; False for a plain name."""
    path = text.rpartition(":")[0] if ":" in text else text
    return ":" in text or path.endswith(".py")


def resolve(text: str, registry: Registered | None = None, *, default_attr: str | None = None) -> Resolved:
    """Resolve ``text`` against ``registry`` first, then as an import reference.

    Raises `UnknownComponentError` (with close matches) for an unknown plain name,
    `ComponentConflictError` for a name two plugins provide, and `BadReferenceError` for a
    reference that cannot be imported.
    """
    if registry is not None and not is_reference(text):
        return Resolved(text, registry.component(text).load(), registered=True)
    if is_reference(text):
        return Resolved(text, import_object(text, default_attr=default_attr), registered=False)
    raise BadReferenceError(f"{text!r} is not a reference: use 'module.path:attr' or 'path/to/file.py:attr'")


def import_object(ref: str, *, default_attr: str | None = None) -> Any:
    """Import ``module.path:attr`` or ``path/to/file.py[:attr]``; ``attr`` may be dotted."""
    target, sep, attr = ref.rpartition(":") if ":" in ref else (ref, "", "")
    if not attr:
        if default_attr is None:
            raise BadReferenceError(f"{ref!r} names no attribute: write it as '{ref}:NAME'")
        attr = default_attr
    if not target:
        raise BadReferenceError(f"{ref!r} names no module: write it as 'module.path:{attr}'")
    module = _load_file(target) if target.endswith(".py") else _load_module(target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(obj) if not n.startswith("_")]
            hint = close_matches(part, public)
            where = getattr(module, "__file__", target)
            raise BadReferenceError(
                f"{target!r} ({where}) has no attribute {part!r}"
                + (f"; did you mean {' or '.join(repr(h) for h in hint)}?" if hint else "")
            )
        obj = getattr(obj, part)
    return obj


def _load_module(name: str) -> Any:
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.append(cwd)  # modules of the current directory import, as under `python -m` (after installed ones)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise BadReferenceError(
                f"cannot import module {name!r}: {exc}. Is its package installed in this environment?"
            ) from exc
        raise BadReferenceError(f"importing module {name!r} failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise BadReferenceError(f"importing module {name!r} failed: {type(exc).__name__}: {exc}") from exc


def _path_problem(exc: BaseException) -> str:
    if "loop" in str(exc).lower() or getattr(exc, "errno", None) == errno.ELOOP:
        return "it is a symbolic link that leads back to itself (a symlink loop)"
    return getattr(exc, "strerror", None) or str(exc)


def _load_file(path_text: str) -> Any:
    try:
        path = Path(path_text).expanduser().resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise BadReferenceError(f"file {path_text!r} cannot be read: {_path_problem(exc)}") from None
    if not path.is_file():
        raise BadReferenceError(f"file {path_text!r} does not exist (looked at {path})")
    # One module per file path, kept in sys.modules so pickling and dataclasses work.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem.lower())
    module_name = f"rlhf_user_{stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[module_name]
        if isinstance(exc, Exception):
            raise BadReferenceError(f"running {path} failed: {type(exc).__name__}: {exc}") from exc
        raise
    return module
