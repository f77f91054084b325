"""Every numeric setting of every registered component declares its range where it is declared
(``metadata={"range": "[0, 1)"}``, rlhf/core/plugin_host/settings.py), and a value outside it is
refused in one line before the component is built (issue 53: ``--lora-rank -4`` trained the whole
model). The walk covers the config classes of every kind, so a new numeric setting without a range
fails here."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.settings import (RANGE, build_component_config, check_range, describe_range, in_range,
                                            parse_range, setting_fields)

pytestmark = pytest.mark.unit


def alternatives(hint) -> list:
    """The types of an Optional or union setting, else the type itself."""
    if typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType":
        return [a for a in typing.get_args(hint) if a is not type(None)]
    return [hint]


def numeric(hint) -> type | None:
    """int or float for a numeric setting (Optional, or a tuple of them), else None."""
    for arg in alternatives(hint):
        if arg in (int, float):
            return arg
        if typing.get_origin(arg) is tuple and typing.get_args(arg) and typing.get_args(arg)[0] in (int, float):
            return typing.get_args(arg)[0]
    return None


def is_tuple(hint) -> int:
    for arg in alternatives(hint):
        if typing.get_origin(arg) is tuple:
            return len(typing.get_args(arg))
    return 0


def outside(spec: str, kind: type) -> list[float]:
    """Values just outside ``spec`` (NaN for floats too)."""
    low, low_in, high, high_in = parse_range(spec)
    step = 1 if kind is int else 1e-3
    values = [] if kind is int else [math.nan]
    if math.isfinite(low):
        values.append(low - step if low_in else low)
    if math.isfinite(high):
        values.append(high + step if high_in else high)
    return values


def registered_settings(plugins):
    for kind, registry in plugins.registries().items():
        for component in registry.components():
            config_cls = component.load_config_cls()
            if config_cls is None:
                continue
            hints = typing.get_type_hints(config_cls)
            for f in setting_fields(config_cls):
                kind_of = numeric(hints[f.name])
                if kind_of is not None:
                    yield kind, component, config_cls, f, kind_of, hints[f.name]


def test_every_numeric_setting_of_every_registered_component_declares_its_range(plugins):
    settings = list(registered_settings(plugins))
    assert len(settings) > 30  # the walk found the built-ins' settings
    missing = [f"{kind} {component.name}: {f.name}" for kind, component, _, f, _, _ in settings if RANGE not in f.metadata]
    assert not missing, f"numeric settings without a declared range: {missing}"
    for _, _, _, f, _, _ in settings:
        low, _, high, _ = parse_range(f.metadata[RANGE])
        assert low < high


def test_every_out_of_range_value_of_every_registered_setting_is_a_config_error(plugins):
    tried = 0
    for kind, component, config_cls, f, kind_of, hint in registered_settings(plugins):
        spec = f.metadata[RANGE]
        if f.default is not None and f.default is not dataclasses.MISSING:  # the default lies in its range
            for number in f.default if isinstance(f.default, tuple) else (f.default,):
                assert in_range(number, spec), (component.name, f.name, f.default, spec)
        for value in outside(spec, kind_of):
            width = is_tuple(hint)
            given = ",".join([str(value)] * width) if width else value
            with pytest.raises(ConfigError, match=f"{f.name.replace('_', '-')} must be"):
                build_component_config(config_cls, settings={f.name: given}, run_values={}, who=f"the {kind}",
                                       flag=f"--{kind}")
            tried += 1
    assert tried > 40


def test_a_short_flag_is_named_as_the_user_typed_it_and_the_range_in_words():
    from rlhf.plugins.models.config import HFModelConfig

    with pytest.raises(ConfigError, match=r"^the 'hf' model: --lora-rank must be at least 0; got -4$"):
        build_component_config(HFModelConfig, settings={"lora_rank": "-4"}, run_values={}, who="the 'hf' model",
                               flag="--model-adapter", short_flags=("lora_rank",))
    assert describe_range("(0, inf)") == "greater than 0" and describe_range("[0, 1)") == "in [0, 1)"
    check_range((0.5, 2.0), "[0, inf)", "x")
    with pytest.raises(ConfigError, match=r"x must be at least 0; got \[0.5, -2.0\]"):
        check_range((0.5, -2.0), "[0, inf)", "x")
