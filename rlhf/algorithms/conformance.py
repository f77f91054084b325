"""Reference fixtures: the numbers an advantage estimator, policy loss, KL estimator or loss
aggregation must reproduce to claim it implements a method (docs/algorithms.md, "Conformance").

A component registered with ``implements="grpo"`` (or a tuple: ``("ppo", "tis")``) is run on the
fixture cases of those names by ``rlhf plugins check`` (`conform`), which reports the largest
difference and fails beyond the tolerance. The fixtures ship in ``fixtures/<kind>.json``, float64:
each set (``"ppo"``, ``"k3"``, ...) holds cases of ``settings`` (the component's config fields),
``inputs`` and ``expected`` outputs, gradients included (the gradient of Σ output · grad_output with
respect to the differentiable input). The mismatch corrections (``tis``, ``icepop``,
``seq_mask_tis``) are policy-loss sets whose cases each name the ``loss`` they run on: a loss that
implements ``("cispo", "tis")`` runs the ``tis`` cases of ``cispo``. ``rlhf plugins check --fixtures
DIR`` writes the files (`export_fixtures`) so other frameworks can check themselves against them.

What a case runs, per kind (every tensor float64; ``B`` rows, ``A`` action positions):

- advantage_estimator: ``obj(AdvantageInputs(rewards (B,), action_mask, kl, kl_coef, values,
  group_size, sample_mask), config)`` -> ``advantages``, ``returns`` (B, A).
- policy_loss: ``obj(PolicyLossInputs(logprobs, old_logprobs, advantages, loss_mask,
  rollout_logprobs), config)`` -> ``loss`` (B, A) and ``grad_logprobs`` (B, A).
- kl_estimator: ``obj(logprobs, ref_logprobs)`` -> ``kl`` and ``grad_logprobs`` (B, A).
- loss_aggregation: ``obj(loss, loss_mask, LossNorm(num_tokens, num_sequences, max_new_tokens))``
  -> ``value`` () and ``grad_loss`` (B, A).

Settings a case gives that the component's config lacks: under ``settings`` the case still runs
(the component must behave as those values), under ``optional_settings`` it is skipped (a feature
the component does not offer, e.g. ppo's dual clip). Host code: it names no built-in.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.core.errors import RlhfError

FIXTURES_DIR = Path(__file__).parent / "fixtures"
FIXTURE_KINDS = ("advantage_estimator", "policy_loss", "kl_estimator", "loss_aggregation")
TOLERANCE = 1e-5  # |got - expected| <= TOLERANCE · max(1, |expected|): float32 arithmetic passes, bugs do not


class ConformanceError(RlhfError):
    """A component cannot be run on its fixtures (no such set, it raised, the wrong shape)."""


@dataclass
class SetResult:
    """How a component did on one fixture set."""

    name: str
    cases: int = 0  # cases run
    largest: float = 0.0  # largest |got - expected| over every output of every case run
    where: str = ""  # the case and output of the largest difference
    failed: str = ""  # the first case and output beyond the tolerance ("" when none)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        line = f"reference fixtures {self.name!r}: {self.cases} case(s), largest difference {self.largest:.3g}"
        return line + (f" ({self.where})" if self.where and self.largest > 0 else "")


def implemented(capabilities: dict[str, Any]) -> tuple[str, ...]:
    """The fixture sets a registration's ``implements`` names (a name or a tuple of names)."""
    value = capabilities.get("implements")
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def load_fixtures(kind: str) -> dict[str, Any]:
    """The shipped fixture file of ``kind`` (its ``sets``, ``tolerance``, ``format``)."""
    return json.loads((FIXTURES_DIR / f"{kind}.json").read_text())


def export_fixtures(directory: str | Path) -> list[Path]:
    """Write every kind's fixture file into ``directory`` (created); returns the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in FIXTURE_KINDS:
        target = out / f"{kind}.json"
        shutil.copyfile(FIXTURES_DIR / f"{kind}.json", target)
        written.append(target)
    return written


def conform(kind: str, obj: Any, names: Iterable[str], *, make_config: Callable[[dict[str, Any]], Any],
            settable: set[str] | None, tolerance: float = TOLERANCE) -> list[SetResult]:
    """Run ``obj`` (a component of ``kind``) on the fixture sets ``names``; one `SetResult` each.

    ``make_config(settings)`` builds the component's config from a case's settings (those it has);
    ``settable`` is the set of its config's setting names (None: it has no config class). Raises
    `ConformanceError` for a set that does not exist, a case that raises or returns the wrong shape.
    """
    if kind not in FIXTURE_KINDS:
        raise ConformanceError(f"there are no reference fixtures for the {kind.replace('_', ' ')} kind")
    names = tuple(names)
    sets = load_fixtures(kind)["sets"]
    results = []
    for name in names:
        if name not in sets:
            raise ConformanceError(f"implements {name!r}, which has no reference fixtures; the "
                                   f"{kind.replace('_', ' ')} sets are: {', '.join(sorted(sets))}")
        result = SetResult(name)
        for case in sets[name]["cases"]:
            if case.get("loss") is not None and case["loss"] not in names:
                continue  # a correction's case on a loss this component does not implement
            _run_case(kind, obj, case, result, make_config, settable, tolerance)
        if not result.cases and not result.notes:
            result.notes.append(f"no case ran: its cases run on {', '.join(_losses(sets[name]))}; implement one "
                                "of them too")
        results.append(result)
    return results


def _losses(fixture_set: dict[str, Any]) -> list[str]:
    return sorted({case["loss"] for case in fixture_set["cases"] if case.get("loss")})


def _run_case(kind: str, obj: Any, case: dict[str, Any], result: SetResult,
              make_config: Callable[[dict[str, Any]], Any], settable: set[str] | None, tolerance: float) -> None:
    have = settable or set()
    optional = case.get("optional_settings", {})
    missing_optional = sorted(set(optional) - have)
    label = f"case {case['name']!r}"
    if missing_optional:
        result.notes.append(f"{label} skipped: its config has no {', '.join(missing_optional)}")
        return
    settings = {**case.get("settings", {}), **optional}
    missing = sorted(set(settings) - have)
    if missing:
        result.notes.append(f"{label} ran without {', '.join(f'{k}={settings[k]!r}' for k in missing)} (its config "
                            "has no such setting: it must behave as these values)")
    try:
        config = make_config({k: v for k, v in settings.items() if k in have}) if settable is not None else None
        outputs = RUNNERS[kind](obj, config, case["inputs"])
    except ConformanceError:
        raise
    except Exception as exc:
        raise ConformanceError(f"{label} of {result.name!r} raised {type(exc).__name__}: {exc}") from exc
    result.cases += 1
    for output, expected in case["expected"].items():
        difference, index, beyond = _compare(outputs[output], expected, tolerance, f"{label}, {output}")
        if difference > result.largest:  # never NaN: `_compare` counts a NaN as an infinite difference
            result.largest, result.where = difference, f"{label}, {output}{index}"
        if beyond and not result.failed:
            result.failed = f"{label}, {output}{index}"


def _compare(got: Any, expected: Any, tolerance: float, what: str) -> tuple[float, str, bool]:
    """(largest |got - expected|, its index, whether some element is beyond the tolerance)."""
    import torch

    want = torch.tensor(expected, dtype=torch.float64)
    if not isinstance(got, torch.Tensor):
        raise ConformanceError(f"{what}: expected a tensor of shape {tuple(want.shape)}, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want.shape):
        raise ConformanceError(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    got = got.detach().to(torch.float64)
    difference = (got - want).abs()  # NaN where got is NaN
    difference = torch.where(torch.isnan(difference), torch.full_like(difference, math.inf), difference)
    if difference.numel() == 0:
        return 0.0, "", False
    flat = int(difference.argmax())
    index = "" if want.dim() == 0 else str([int(i) for i in torch.unravel_index(torch.tensor(flat), want.shape)])
    beyond = bool((difference > tolerance * want.abs().clamp(min=1.0)).any())
    return float(difference.flatten()[flat]), index, beyond


# --- running one case, per kind ---------------------------------------------------------------------


def _tensor(value: Any, dtype: Any = None) -> Any:
    import torch

    return None if value is None else torch.tensor(value, dtype=dtype or torch.float64)


def _run_advantage_estimator(obj: Any, config: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rlhf.core.types import AdvantageInputs

    sample_mask = inputs.get("sample_mask")
    with torch.no_grad():
        advantages, returns = obj(AdvantageInputs(
            rewards=_tensor(inputs["rewards"]), action_mask=_tensor(inputs["action_mask"]),
            kl=_tensor(inputs.get("kl")), kl_coef=inputs.get("kl_coef", 0.0), values=_tensor(inputs.get("values")),
            group_size=inputs["group_size"],
            sample_mask=None if sample_mask is None else _tensor(sample_mask, torch.bool)), config)
    return {"advantages": advantages, "returns": returns}


def _run_policy_loss(obj: Any, config: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from rlhf.core.types import PolicyLossInputs

    logprobs = _tensor(inputs["logprobs"]).requires_grad_(True)  # (B, A)
    loss, _ = obj(PolicyLossInputs(logprobs=logprobs, old_logprobs=_tensor(inputs["old_logprobs"]),
                                   advantages=_tensor(inputs["advantages"]), loss_mask=_tensor(inputs["loss_mask"]),
                                   rollout_logprobs=_tensor(inputs.get("rollout_logprobs"))), config)
    return {"loss": loss, "grad_logprobs": _gradient(loss, logprobs, inputs["grad_output"])}


def _run_kl_estimator(obj: Any, config: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    logprobs = _tensor(inputs["logprobs"]).requires_grad_(True)  # (B, A)
    kl = obj(logprobs, _tensor(inputs["ref_logprobs"]))
    return {"kl": kl, "grad_logprobs": _gradient(kl, logprobs, inputs["grad_output"])}


def _run_loss_aggregation(obj: Any, config: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    from rlhf.core.types import LossNorm

    loss = _tensor(inputs["loss"]).requires_grad_(True)  # (B, A)
    norm = LossNorm(num_tokens=inputs["num_tokens"], num_sequences=inputs["num_sequences"],
                    max_new_tokens=inputs.get("max_new_tokens"))
    value = obj(loss, _tensor(inputs["loss_mask"]), norm)
    return {"value": value, "grad_loss": _gradient(value, loss, 1.0)}


def _gradient(output: Any, wrt: Any, grad_output: Any) -> Any:
    """∂ Σ(output · grad_output) / ∂ wrt (zeros when the output does not depend on it)."""
    import torch

    if not isinstance(output, torch.Tensor) or not output.requires_grad:
        return torch.zeros_like(wrt)
    weights = _tensor(grad_output) if not isinstance(grad_output, float) else torch.tensor(grad_output)
    (gradient,) = torch.autograd.grad((output.to(torch.float64) * weights).sum(), wrt, allow_unused=True)
    return torch.zeros_like(wrt) if gradient is None else gradient


RUNNERS: dict[str, Callable[[Any, Any, dict[str, Any]], dict[str, Any]]] = {
    "advantage_estimator": _run_advantage_estimator,
    "policy_loss": _run_policy_loss,
    "kl_estimator": _run_kl_estimator,
    "loss_aggregation": _run_loss_aggregation,
}
