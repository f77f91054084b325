"""Every fast path is compared with the plain path where it runs, once per model and per variant.

A fast path computes what a plain one does (the model's own forward over padded rows, its own
decode step) in another way. Before a model takes a fast path the first time, the caller computes
both on the same input and `settle` keeps the verdict on the model, under the path's name: a
variant that runs different code has a name of its own (``prefix_sharing/segment`` and
``prefix_sharing/masked``; ``lean_decode/padded/grouped``, ...; ``packing/segments`` and
``packing/masked``), so each is checked on its own first use, not only the first path taken. A path that differs beyond float rounding
is not taken again on that model: the plain path runs, after one warning that names the switch
turning the fast path off (and so the check).

Shape-free: callers hand in the largest absolute difference they measured.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)

_VERDICTS = "_rlhf_fast_path_verdicts"  # {path: bool}, kept in the model's __dict__


def _store(model: Any) -> dict[str, bool]:
    return model.__dict__.setdefault(_VERDICTS, {})


def verdict(model: Any, path: str) -> bool | None:
    """True or False once ``path`` was checked on ``model``; None before."""
    return model.__dict__.get(_VERDICTS, {}).get(path)


def settle(model: Any, path: str, difference: float, tolerance: float, *, who: str, switch: str) -> bool:
    """Keep whether ``path`` agrees with the plain path on ``model`` (``difference`` <= ``tolerance``;
    a difference that is not finite, NaN or ±inf, never agrees); warn once when it does not. Returns
    the verdict."""
    agrees = math.isfinite(difference) and difference <= tolerance
    _store(model)[path] = agrees
    if not agrees:
        log.warning("%s: the fast path %s differs from the plain path by %.3g (tolerance %.3g); this model runs "
                    "the plain path from now on (%s turns the fast path off)", who, path, difference, tolerance,
                    switch)
    return agrees
