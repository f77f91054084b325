"""What a check hands back: its figures and the criteria it judged, and the tolerances it judges with.

A check passes when no criterion is false. A criterion may be ``None``, "not judged": the dry run's
toy sizes on a CPU cannot show learning, so learning criteria are reported there, not applied.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Criterion:
    name: str
    ok: bool | None  # None: not judged (and why is in detail)
    detail: str = ""


@dataclass
class Verdict:
    figures: dict[str, Any] = field(default_factory=dict)
    criteria: list[Criterion] = field(default_factory=list)
    note: str = ""
    skipped: str = ""  # why the check did not run ("" when it ran)
    tests: list[dict[str, Any]] = field(default_factory=list)  # pytest's cases: name, outcome, message, figures

    @property
    def status(self) -> str:
        if self.skipped:
            return "skip"
        return "fail" if any(c.ok is False for c in self.criteria) else "pass"

    def judge(self, name: str, ok: bool | None, detail: str = "") -> bool | None:
        self.criteria.append(Criterion(name, ok, detail))
        return ok

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(figures=data.get("figures", {}), criteria=[Criterion(**c) for c in data.get("criteria", [])],
                   note=data.get("note", ""), skipped=data.get("skipped", ""), tests=data.get("tests", []))


# |a - b| <= ABS + REL * max(|a|, |b|): bf16 keeps 8 significant bits (relative spacing 2**-8 = 0.4 %),
# and a loss sums hundreds of such roundings in a different order packed or padded, sharded or not.
TOLERANCES = {"bf16": (1e-2, 2e-2), "fp32": (1e-6, 1e-4)}


def close(a: float, b: float, precision: str) -> bool:
    absolute, relative = TOLERANCES[precision]
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= absolute + relative * max(abs(a), abs(b))


def compare(verdict: Verdict, what: str, a: float | None, b: float | None, precision: str) -> None:
    """Judge ``a`` equal to ``b`` within ``precision``'s tolerance; the difference becomes a figure."""
    if a is None or b is None:
        verdict.judge(what, False, f"missing: {a} vs {b}")
        return
    verdict.figures[f"{what} diff"] = abs(a - b)
    absolute, relative = TOLERANCES[precision]
    verdict.judge(what, close(a, b, precision), f"{a:.6g} vs {b:.6g} (tolerance {absolute:g} + {relative:g} x |value|, {precision})")


def series(metrics: list[dict[str, Any]], key: str) -> list[float]:
    return [float(m[key]) for m in metrics if key in m]


def at_step(metrics: list[dict[str, Any]], step: int, key: str) -> float | None:
    for m in metrics:
        if m.get("step") == step and key in m:
            return float(m[key])
    return None


def steady_median(values: list[float]) -> float | None:
    """Median without the first value (the first step compiles kernels and warms caches)."""
    rest = values[1:] or values
    return statistics.median(rest) if rest else None


def ends(values: list[float]) -> tuple[float | None, float | None]:
    """Means of the first and the last quarter of ``values`` (at least one value each)."""
    if not values:
        return None, None
    k = max(1, len(values) // 4)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def all_finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)
