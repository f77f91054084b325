"""What a contract check receives (`Target`) and raises (`ContractError`), and the helpers every
check shares: the component's config built as a run would build it, a tiny model, tensor asserts."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.core.errors import RlhfError

if TYPE_CHECKING:
    import torch

    from rlhf.core.plugin_host.loading import PluginSet

# The run values a check offers to a component's run fields (rlhf.core.plugin_host.settings.RUN_VALUES).
CHECK_RUN_VALUES: dict[str, Any] = {
    "seed": 0, "dtype": "fp32", "device": "cpu", "trust_remote_code": False, "max_prompt_length": 16,
    "max_new_tokens": 8, "max_turns": 1, "max_total_tokens": 24, "temperature": 1.0, "lr": 1e-2,
    "total_steps": 4, "micro_batch_size": 2, "synced_generation": False, "save_critic": False,
    "verify_weight_sync": True, "weight_sync_timeout_s": 600.0,
}


class ContractError(RlhfError):
    """A component broke its kind's contract; the message says which promise and how."""


@dataclass
class Target:
    """One component to check: its kind, name, object and registration."""

    kind: str
    name: str
    obj: Any
    config_cls: Any = None
    capabilities: dict[str, Any] = field(default_factory=dict)
    plugins: PluginSet | None = None
    tolerance: float | None = None  # of the reference fixtures (`expect_conformance`); None: the fixtures' own
    _workdir: Path | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return f"{self.kind.replace('_', ' ')} {self.name!r}"

    def fail(self, message: str) -> ContractError:
        return ContractError(f"{self.label}: {message}")

    def config(self, settings: dict[str, Any] | None = None, **run_values: Any) -> Any:
        """The component's config object with default settings (or ``settings``) and the check's run
        values (None without a config class)."""
        from rlhf.core.plugin_host.settings import build_component_config

        if self.config_cls is None:
            return None
        values = {**CHECK_RUN_VALUES, **run_values}
        if "model" not in values and _wants(self.config_cls, ("model", "tokenizer")):
            values["model"] = values["tokenizer"] = str(self.tiny_model())
        try:
            return build_component_config(self.config_cls, settings=settings or {}, run_values=values,
                                          who=self.label, flag="")
        except Exception as exc:
            raise self.fail(f"its config class {self.config_cls.__name__} cannot be built with default "
                            f"settings: {exc}") from exc

    def workdir(self) -> Path:
        """A temporary folder for this check (removed when the process ends)."""
        if self._workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rlhf-check-")
            self._workdir = Path(self._tmp.name)
        return self._workdir

    def tiny_model(self) -> Path:
        """A random-weight tiny Llama and its tokenizer, saved once per process."""
        from rlhf.plugin_kit.tiny_model import cached_tiny_model

        return cached_tiny_model()


def _wants(config_cls: type, names: tuple[str, ...]) -> bool:
    import dataclasses

    from rlhf.core.plugin_host.settings import run_value_of

    return any(run_value_of(f) in names for f in dataclasses.fields(config_cls))


# --- tensor asserts ------------------------------------------------------------------------


def expect_tensor(target: Target, what: str, value: Any, shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    if not isinstance(value, torch.Tensor):
        raise target.fail(f"{what} should be a tensor of shape {shape}, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise target.fail(f"{what} has shape {tuple(value.shape)}, expected {shape}")
    if not value.is_floating_point():
        raise target.fail(f"{what} should be a float tensor, got {value.dtype}")
    expect_finite(target, what, value)
    return value


def expect_finite(target: Target, what: str, value: torch.Tensor) -> None:
    import torch

    bad = ~torch.isfinite(value)
    if bad.any():
        where = [tuple(i.tolist()) for i in bad.nonzero()[:3]]
        raise target.fail(f"{what} is NaN or inf at {where}")


def expect_zero_where_masked(target: Target, what: str, value: torch.Tensor, mask: torch.Tensor, *,
                             mask_name: str) -> None:
    leaked = (value != 0) & (mask == 0)
    if leaked.any():
        where = [tuple(i.tolist()) for i in leaked.nonzero()[:3]]
        raise target.fail(f"{what} is not zero where {mask_name} is 0, e.g. at {where} "
                          f"(value {value[where[0]].item():.4g}); multiply by the mask")


def expect_close(target: Target, what: str, got: torch.Tensor, expected: torch.Tensor, *, atol: float = 1e-5) -> None:
    import torch

    if not torch.allclose(got, expected, atol=atol, rtol=1e-4):
        diff = (got - expected).abs().max().item()
        raise target.fail(f"{what} (largest difference {diff:.3g})")


def finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def guarded(target: Target, what: str, fn: Any) -> Any:
    """``fn()``; any exception but a `ContractError` becomes one saying that ``what`` raised it."""
    try:
        return fn()
    except ContractError:
        raise
    except Exception as exc:
        raise target.fail(f"{what} raised {type(exc).__name__}: {exc}") from exc


def expect_conformance(target: Target) -> list[str]:
    """The reference fixtures of each method the component's registration ``implements``
    (`rlhf.algorithms.conformance`): one line per set with its largest difference; a `ContractError`
    naming the case and output when a difference is beyond the tolerance. No lines without ``implements``."""
    from rlhf.algorithms.conformance import TOLERANCE, ConformanceError, conform, implemented
    from rlhf.core.plugin_host.settings import setting_fields

    names = implemented(target.capabilities)
    if not names:
        return []
    tolerance = TOLERANCE if target.tolerance is None else target.tolerance
    settable = None if target.config_cls is None else {f.name for f in setting_fields(target.config_cls)}
    try:
        results = conform(target.kind, target.obj, names, make_config=lambda settings: target.config(settings),
                          settable=settable, tolerance=tolerance)
    except ConformanceError as exc:
        raise target.fail(f"reference fixtures: {exc}") from exc
    lines = []
    for result in results:
        lines += [result.describe()] + [f"  {note}" for note in result.notes]
        if result.failed:
            raise target.fail(f"does not match the reference fixtures of {result.name!r}: largest difference "
                              f"{result.largest:.3g} at {result.where} (tolerance {tolerance:g}, relative above 1); "
                              f"first beyond it: {result.failed}")
        if not result.cases:
            raise target.fail(f"implements {result.name!r} but ran none of its reference fixtures: "
                              f"{'; '.join(result.notes)}")
    return lines
