"""What reward functions may return, turned into one value per sample.

Batched functions return a list, tuple, tensor or array of numbers (``None`` = no score), or a
dict with ``rewards`` plus optional ``scores`` and ``extra_logs`` (OpenRLHF). Per-sample functions
return a number, ``None``, or a dict with ``score`` whose other numeric keys are logged (verl).
Numbers may be Python, numpy or torch scalars, bools, or one-element lists (OpenRLHF servers send
``[[0.5], [1.0]]``). Anything else is a failure with a message saying what was expected; nothing is
broadcast (TRL #6533: a single value silently applied to every sample).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from rlhf.rewards.failures import excerpt


class BadReturn(Exception):
    """A whole call's return value is unusable (every sample of the call fails)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def to_number(value: Any) -> float | None:
    """A float (possibly non-finite) or ``None``; ``ValueError`` for anything that is not a number."""
    if value is None:
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # torch / numpy scalars and arrays
        return to_number(value.tolist())
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return to_number(value[0])
    raise ValueError(f"{type(value).__name__} {excerpt(value, 60)} is not a number")


def as_list(value: Any, n: int, what: str) -> list[Any]:
    """``value`` as a list of exactly ``n`` items, or `BadReturn`."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise BadReturn("wrong length", f"{what} is a single {type(value).__name__}, not a list of {n} "
                                        "values (one per sample)")
    if len(value) != n:
        raise BadReturn("wrong length", f"{what} has {len(value)} values for {n} samples")
    return list(value)


def numeric_logs(logs: Any) -> dict[str, list[float]]:
    """Flatten ``extra_logs`` (scalars, lists, tensors) into finite floats per key; skip what is not numeric."""
    out: dict[str, list[float]] = {}
    if not isinstance(logs, dict):
        return out
    for key, value in logs.items():
        if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
            value = value.tolist()
        items = value if isinstance(value, (list, tuple)) else [value]
        numbers_: list[float] = []
        for item in items:
            try:
                number = to_number(item)
            except ValueError:
                continue
            if number is not None and math.isfinite(number):
                numbers_.append(number)
        if numbers_:
            out[str(key)] = numbers_
    return out


def batched_return(result: Any, n: int) -> tuple[list[Any], list[float | None] | None, dict[str, list[float]]]:
    """Split a batched function's result into raw values, optional scores and extra logs."""
    if isinstance(result, dict):
        if "rewards" not in result:
            keys = ", ".join(map(str, result)) or "none"
            raise BadReturn("bad value", f"returned a dict without 'rewards' (keys: {keys}); return a list of "
                                         "numbers, or {'rewards': [...]} as OpenRLHF reward functions do")
        values = as_list(result["rewards"], n, "'rewards'")
        scores = None
        if result.get("scores") is not None:
            scores = [_lenient(s) for s in as_list(result["scores"], n, "'scores'")]
        return values, scores, numeric_logs(result.get("extra_logs"))
    return as_list(result, n, "the result"), None, {}


def sample_return(result: Any) -> tuple[Any, dict[str, float]]:
    """Split a per-sample function's result into the raw value and numeric extras (verl's dict)."""
    if isinstance(result, dict):
        if "score" not in result:
            keys = ", ".join(map(str, result)) or "none"
            raise BadReturn("bad value", f"returned a dict without 'score' (keys: {keys}); verl-style functions "
                                         "return a number or {'score': ...}")
        extras = {k: v[0] for k, v in numeric_logs({k: v for k, v in result.items() if k != "score"}).items()
                  if len(v) == 1}
        return result["score"], extras
    return result, {}


def _lenient(value: Any) -> float | None:
    try:
        number = to_number(value)
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None
