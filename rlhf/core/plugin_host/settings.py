"""How a component's own config class is filled: from the user's settings for that component, and
from run values the class asks for by name. Nothing reaches a config by an accidental name match.

A component registered with ``config_cls`` (a ``@dataclass(kw_only=True)``) has two sorts of field:

* **settings**, the user's: each gets a namespaced command-line flag,
  ``--<slot>.<field>`` (``--policy-loss.clip-high 0.28``, ``--backend.zero-stage 3``), a key under
  ``components: {<slot>: {...}}`` in a ``--config`` file, and ``--algo-config KEY=VALUE``;
* **run fields**, declared with ``metadata={"run": NAME}`` (or `run_field`): the run fills them with
  its value ``NAME`` (one of `RUN_VALUES`); they have no flag of their own. A field called ``seed``
  without ``"run"`` is a setting like any other: the run's ``--seed`` never reaches it.

Values from the command line, YAML files and ``KEY=VALUE`` strings are converted to the field's
annotated type by `coerce` (``"0.9,0.95"`` to ``tuple[float, float]``, ``"true"`` to ``bool``, ...).

A numeric setting declares the values it takes where it is declared, ``metadata={"range": "[0, 1)"}``
(interval notation, ``inf`` for no bound; each number of a tuple setting), and a value outside it is
a `ConfigError` naming the flag before the component is built (``--lora-rank -4`` never reaches
the model). A number is never NaN.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from rlhf.core.errors import ConfigError

RUN = "run"  # field metadata key naming the run value a field receives
RANGE = "range"  # field metadata key: the interval a numeric setting's values lie in, e.g. "[0, 1)"

# The values a run offers to the components it builds, by name (``metadata={"run": NAME}``).
RUN_VALUES: dict[str, str] = {
    "seed": "the run's random seed (--seed)",
    "model": "the policy model directory or hub name (--model)",
    "tokenizer": "the tokenizer directory or hub name (--tokenizer, else --model)",
    "dtype": "the weights dtype (--dtype: auto, bf16, fp16, fp32)",
    "device": "the device of this process's models (--device)",
    "trust_remote_code": "whether model code shipped with a checkpoint may run (--trust-remote-code)",
    "max_prompt_length": "prompt tokens kept (--max-prompt-length)",
    "max_new_tokens": "generation budget per completion (--max-new-tokens)",
    "max_turns": "model turns per trajectory (--max-turns)",
    "max_total_tokens": "token budget per trajectory, resolved (--max-total-tokens, else prompt + turns)",
    "temperature": "the sampling temperature (--temperature)",
    "lr": "the learning rate of the model this backend trains (--lr for the policy, --critic-lr for the critic)",
    "total_steps": "optimizer steps in the whole run (for LR schedules)",
    "micro_batch_size": "samples per forward/backward (--micro-batch-size)",
    "synced_generation": "whether ranks must generate in lockstep (a backend that shards weights, several ranks)",
    "save_critic": "whether the run writes the critic at the end (--save-critic)",
    "verify_weight_sync": "whether an engine with weights of its own verifies every sync (--verify-weight-sync)",
    "weight_sync_timeout_s": "seconds one weight sync may take (--weight-sync-timeout-s; 0: no limit)",
}


def run_field(name: str, default: Any, help: str) -> Any:
    """A config field the run fills with its value ``name`` (one of `RUN_VALUES`)."""
    if name not in RUN_VALUES:
        raise ValueError(f"unknown run value {name!r}; the run offers: {', '.join(sorted(RUN_VALUES))}")
    return dataclasses.field(default=default, metadata={"help": help, RUN: name})


def run_value_of(f: dataclasses.Field) -> str | None:
    return f.metadata.get(RUN)


def setting_fields(config_cls: type | None) -> list[dataclasses.Field]:
    """The fields a user sets (run fields excluded), in declaration order."""
    if config_cls is None:
        return []
    return [f for f in dataclasses.fields(config_cls) if run_value_of(f) is None]


def check_config_cls(config_cls: Any) -> str | None:
    """``None`` when ``config_cls`` can be a component config, else what it should have been."""
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        return "a dataclass"
    for f in dataclasses.fields(config_cls):
        name = run_value_of(f)
        if name is not None and name not in RUN_VALUES:
            return f"a dataclass whose run fields name run values ({f.name} asks for unknown {name!r})"
    return None


def build_component_config(config_cls: type | None, *, settings: Mapping[str, Any], run_values: Mapping[str, Any],
                           who: str, flag: str, short_flags: tuple[str, ...] = ()) -> Any:
    """An instance of ``config_cls`` from the user's ``settings`` and the run's ``run_values``.

    ``who`` names the component in messages (``"the 'torch' backend"``), ``flag`` its namespace
    (``"--backend"``; a setting in ``short_flags`` is named by its plain flag). A setting the class lacks, or one that is a run field, is a `ConfigError`
    listing what can be set. Returns None when the component has no config class (and no setting).
    """
    settable = {f.name: f for f in setting_fields(config_cls)}
    unknown = sorted(set(settings) - set(settable))
    if unknown:
        name = unknown[0]
        run_fields = {f.name: run_value_of(f) for f in dataclasses.fields(config_cls)} if config_cls else {}
        if name in run_fields:
            raise ConfigError(f"{who} receives {name} from the run ({RUN_VALUES[run_fields[name]]}), so "
                              f"{flag}.{_dashed(name)} cannot be set; set the run's value instead")
        raise ConfigError(f"{who} has no option {name} ({flag}.{_dashed(name)}); its options: "
                          f"{', '.join(settable) or 'none'}{did_you_mean(name, settable)}")
    if config_cls is None:
        return None
    hints = typing.get_type_hints(config_cls)
    values = {name: coerce(value, hints[name], f"{flag}.{_dashed(name)}") for name, value in settings.items()}
    for name, value in values.items():
        shown = f"--{_dashed(name)}" if name in short_flags else f"{flag}.{_dashed(name)}"
        check_range(value, settable[name].metadata.get(RANGE), f"{who}: {shown}")
    for f in dataclasses.fields(config_cls):
        name = run_value_of(f)
        if name is not None and name in run_values:
            values[f.name] = run_values[name]
    try:
        return config_cls(**values)
    except ConfigError:
        raise
    except Exception as exc:  # the config class's own validation (__post_init__)
        raise ConfigError(f"{who}: {exc}") from exc


def parse_range(spec: str) -> tuple[float, bool, float, bool]:
    """``"[0, 1)"`` -> ``(0.0, True, 1.0, False)``: low, low included, high, high included."""
    text = spec.strip()
    if len(text) < 5 or text[0] not in "[(" or text[-1] not in "])" or "," not in text:
        raise ValueError(f"a range is written like [0, 1) or (0, inf); got {spec!r}")
    low, high = (float(part) for part in text[1:-1].split(","))
    return low, text[0] == "[", high, text[-1] == "]"


def in_range(number: float, spec: str) -> bool:
    low, low_in, high, high_in = parse_range(spec)
    return (low < number or (low_in and number == low)) and (number < high or (high_in and number == high))


def check_range(value: Any, spec: str | None, where: str) -> None:
    """Refuse a number (or a number of a tuple or list) that is NaN or outside ``spec`` ("[0, 1)"; None: any)."""
    for number in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            continue
        if number != number:
            raise ConfigError(f"{where} must be a number; got {number}")
        if spec is not None and not in_range(number, spec):
            got = list(value) if isinstance(value, (tuple, list)) else value
            raise ConfigError(f"{where} must be {describe_range(spec)}; got {got}")


def describe_range(spec: str) -> str:
    """``"[1, inf)"`` -> ``"at least 1"``, ``"(0, inf)"`` -> ``"greater than 0"``, else ``"in [0, 1)"``."""
    low, low_in, high, _ = parse_range(spec)
    if high == float("inf") and low != float("-inf"):
        return f"{'at least' if low_in else 'greater than'} {low:g}"
    return f"in {spec}"


def did_you_mean(name: str, candidates: Any) -> str:
    """``; did you mean NAME?`` with the candidate ``name`` is closest to (the end of a message), or nothing."""
    from rlhf.core.errors import close_matches

    hint = close_matches(name, sorted(candidates), n=1)
    return f"; did you mean {hint[0]}?" if hint else ""


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` converted to the annotated type ``hint`` (strings parsed, lists to tuples, ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null") and type(None) in args):
            return None
        others = [a for a in args if a is not type(None)]
        errors = []
        for candidate in others:
            try:
                return coerce(value, candidate, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: cannot use {value!r}")
    if hint is Any or hint is object:
        return value
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            number = hint(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {'an integer' if hint is int else 'a number'}, got {value!r}") from None
        if hint is int and isinstance(value, float) and number != value:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return number
    if hint is str:
        return str(value)
    if origin in (tuple, list) or hint in (tuple, list):
        items = _items(value)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(items) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} values separated by commas, got {value!r}")
            return tuple(coerce(item, arg, where) for item, arg in zip(items, args))
        element = args[0] if args else Any
        converted = [coerce(item, element, where) for item in items]
        return tuple(converted) if (origin or hint) is tuple else converted
    if origin is dict or hint is dict:
        if isinstance(value, str):
            from rlhf.core.inputs.safe_yaml import load_yaml

            value = load_yaml(value, where) or {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    return value


def _items(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        items = []
        for item in value:  # a repeatable flag may give "a,b" items
            items += _items(item) if isinstance(item, str) and "," in item else [item]
        return items
    return [value]


def resolve_flag(value: Any, config: Any) -> Any:
    """A registration flag that may be a function of the component's config object (an objective's
    ``needs_reference``, a backend's ``shards_weights``): its value for ``config``."""
    return value(config) if callable(value) else value
