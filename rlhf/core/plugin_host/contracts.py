"""Checking an object or class against a written protocol, so a contract is enforced where a
component is registered instead of being probed with ``hasattr`` where it is used.

A protocol is a ``typing.Protocol`` class: its methods and annotated attributes are the members
(names starting with ``_`` are not). Capability flags are annotated attributes with a value the
implementation declares (a class attribute or a property), e.g. ``shards_weights: bool``.

Optional members a contract lets a class declare (the registration flags of a class used by
``module:attr`` reference, an environment's ``stop``, ``blocking`` and ``close``, the
``sample_*`` attributes ``rlhf plugins check`` reads) are read with `declared`, once, where the
class is registered or resolved, never where the component is used.
"""

from __future__ import annotations

import inspect
from typing import Any

_PROTOCOL_INTERNALS = {"_is_protocol", "_is_runtime_protocol", "__protocol_attrs__", "__non_callable_proto_members__"}


def protocol_members(protocol: type) -> list[str]:
    """The public methods and attributes a protocol declares (its bases' included), sorted."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (object,) or cls.__name__ in ("Protocol", "Generic"):
            continue
        names.update(getattr(cls, "__annotations__", {}))
        names.update(name for name, value in vars(cls).items() if callable(value) or isinstance(value, property))
    return sorted(n for n in names if not n.startswith("_") and n not in _PROTOCOL_INTERNALS)


def missing_members(obj: Any, protocol: type) -> list[str]:
    """Members of ``protocol`` that ``obj`` (a class or an instance) lacks."""
    return [name for name in protocol_members(protocol) if not _has(obj, name)]


def _has(obj: Any, name: str) -> bool:
    if inspect.isclass(obj):
        # Attributes set in __init__ do not show on the class; the protocols' attributes are
        # capability flags and properties, which implementations declare on the class.
        return any(name in vars(cls) or name in getattr(cls, "__annotations__", {}) for cls in obj.__mro__)
    return hasattr(obj, name)


def declared(obj: Any, name: str, default: Any = None) -> Any:
    """What ``obj`` (a class, or a function) declares for the optional member ``name``, its own or
    a base class's, without running a descriptor or ``__getattr__``; ``default`` when it declares
    none. A ``staticmethod`` declared on a class is its function."""
    value = inspect.getattr_static(obj, name, default)
    return value.__func__ if isinstance(value, staticmethod) else value


def declares(cls: type, name: str) -> bool:
    """Whether ``cls`` (or a base) defines the optional member ``name``."""
    return declared(cls, name, _ABSENT) is not _ABSENT


_ABSENT = object()


def describe_missing(obj: Any, protocol: type) -> str | None:
    """``None`` when ``obj`` has every member, else what it should have been (for `Kind.check`)."""
    missing = missing_members(obj, protocol)
    if not missing:
        return None
    return f"a class implementing {protocol.__module__}.{protocol.__qualname__} (missing: {', '.join(missing)})"
