"""From ``--reward SPEC[@WEIGHT]`` to reward sources (docs/rewards.md).

SPEC resolves, in order: an ``http(s)://`` URL (several, comma-separated, are load-balanced); a
registered reward name; ``file.py[:func]`` (default ``reward_func``); ``module:attr``; a directory
holding a model config (a reward model); ``org/name`` that names nothing here (registered names
have no ``/``): a reward model on the Hugging Face hub, from the local cache or downloaded
(`rlhf.core.hub`). ``@WEIGHT`` is a trailing number (default 1; weight 0 logs a source without
using it).

A source's metric name is the registered name, the function's ``__name__``, the first URL's host or
the model directory's (or hub model's) name; names made equal by two sources get ``_2``, ``_3``, ...
suffixes.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rlhf.core.errors import ConfigError, UnknownComponentError
from rlhf.core.hub import check_model_option, hub_model_dir, is_hub_name
from rlhf.core.plugin_host.references import import_object, is_reference
from rlhf.core.plugin_host.registry import Registry
from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.combine import RESERVED_NAMES, RewardSet
from rlhf.rewards.failures import RewardConfigError
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.remote import HttpSource, parse_urls
from rlhf.rewards.reward_model import RewardModelSource, is_model_dir
from rlhf.rewards.source import RewardSource

log = logging.getLogger(__name__)

SPEC_FORMS = ("an http(s):// URL, a registered reward name, file.py[:func] (default func reward_func), "
              "module:attr, a directory holding a reward model's config.json, or a hub reward model org/name")


def split_weight(spec: str) -> tuple[str, float]:
    """``"exact_match@0.5"`` -> ``("exact_match", 0.5)``; an ``@`` not followed by a number is kept."""
    head, sep, tail = spec.strip().rpartition("@")
    if not sep or not head:
        return spec.strip(), 1.0
    try:
        weight = float(tail)
    except ValueError:
        return spec.strip(), 1.0
    if not math.isfinite(weight):
        raise RewardConfigError(f"reward weight must be a finite number, got {tail!r} in {spec!r}")
    return head, weight


def clean_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.") or "reward"


def describe_function(fn: Any) -> str:
    """``qualname (file:line)`` or ``module.qualname``: where a reward function lives."""
    target = inspect.unwrap(getattr(fn, "func", fn))  # functools.partial and decorators
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target)
    qualname = getattr(target, "__qualname__", repr(target))
    try:
        file, line = inspect.getsourcefile(target), inspect.getsourcelines(target)[1]
    except (OSError, TypeError):
        file, line = None, 0
    return f"{qualname} ({file}:{line})" if file else f"{getattr(target, '__module__', '?')}.{qualname}"


def function_name(fn: Any) -> str:
    target = getattr(fn, "func", fn)
    return clean_name(getattr(target, "__name__", None) or type(target).__name__)


def build_source(spec: str, registry: Registry | None, options: RewardOptions) -> RewardSource:
    """One reward source from a SPEC (without ``@WEIGHT``)."""
    text = spec.strip()
    if text.lower().startswith(("http://", "https://")):
        urls = parse_urls(text)
        return HttpSource(urls, clean_name(urlsplit(urls[0]).hostname or "http"), options)
    if not is_reference(text):
        if registry is not None and text in registry:
            component = registry.component(text)
            obj = component.load()
            where = f"{component.name} from {component.provider.label}: {describe_function(obj)}"
            return _function_source(obj, component.name, where, options, component.capabilities)
        if is_model_dir(text):
            return RewardModelSource(Path(text), clean_name(Path(text).resolve().name), options)
        if Path(text).is_dir():
            raise RewardConfigError(f"directory {text!r} holds no config.json, so it is not a reward model")
        if is_hub_name(text):
            return RewardModelSource(hub_model_dir(text, "--reward"), clean_name(text.rpartition("/")[2]), options)
        hint = f"A reward spec is {SPEC_FORMS}."
        if registry is None:
            raise UnknownComponentError("reward", text, [], hint=hint)
        try:
            registry.component(text)  # raises; a name two plugins provide gets its own error
        except UnknownComponentError as exc:
            raise UnknownComponentError("reward", text, exc.available, hint=hint, aliases=exc.aliases) from None
    obj = import_object(text, default_attr="reward_func")
    return _function_source(obj, None, describe_function(obj) if callable(obj) else text, options, {})


def is_hub_reward_model(spec: str, registry: Registry | None) -> bool:
    """A SPEC (without ``@WEIGHT``) that `build_source` takes as a hub reward model."""
    text = spec.strip()
    return (not text.lower().startswith(("http://", "https://")) and not is_reference(text)
            and not (registry is not None and text in registry) and is_hub_name(text))


def check_hub_reward_models(specs: Sequence[str], registry: Registry | None) -> None:
    """Before any model loads: each ``--reward`` SPEC taken as a hub reward model is in the local
    cache, or (online) on the hub; otherwise one error naming it (`rlhf.core.hub.check_model_option`)."""
    for spec in specs:
        text = split_weight(spec)[0]
        if is_hub_reward_model(text, registry):
            try:
                check_model_option(text, "--reward")
            except ConfigError as exc:
                raise RewardConfigError(f"{exc} ({text} is no registered reward, file.py or module:attr, so it is "
                                        "taken as a hub reward model)") from None


def _function_source(obj: Any, name: str | None, where: str, options: RewardOptions,
                     capabilities: dict[str, Any]) -> RewardSource:
    if isinstance(obj, RewardSource):
        return obj
    if not callable(obj):
        raise RewardConfigError(f"reward {where} is a {type(obj).__name__}, not a function")
    return FunctionSource(obj, name or function_name(obj), where, options,
                          batched=capabilities.get("batched"), is_async=capabilities.get("is_async"))


def unique_names(sources: Sequence[RewardSource]) -> None:
    """Rename sources in place so metric names never collide (``exact_match``, ``exact_match_2``)."""
    used = set(RESERVED_NAMES)
    for source in sources:
        base, candidate, k = source.name, source.name, 2
        while candidate in used:
            candidate, k = f"{base}_{k}", k + 1
        source.name = candidate
        used.add(candidate)


def build_set(specs: Sequence[str], registry: Registry | None, options: RewardOptions) -> RewardSet:
    """A `RewardSet` from ``SPEC[@WEIGHT]`` strings."""
    if not specs:
        raise RewardConfigError(f"no reward given: pass --reward SPEC (SPEC is {SPEC_FORMS})")
    sources, weights = [], []
    for spec in specs:
        text, weight = split_weight(spec)
        sources.append(build_source(text, registry, options))
        weights.append(weight)
    unique_names(sources)
    warn_untimed(sources, options)
    return RewardSet(sources, weights, on_error=options.on_error)


def warn_untimed(sources: Sequence[RewardSource], options: RewardOptions) -> None:
    """A timeout that was asked for but cannot apply (a sync function runs in the calling thread) is said."""
    default = RewardOptions.__dataclass_fields__["timeout_s"].default
    inline = [s.name for s in sources if isinstance(s, FunctionSource) and s.inline]
    if inline and options.timeout_s != default:
        log.warning("--reward-timeout-s %g does not apply to the sync reward function(s) %s: they run in the calling "
                    "thread. Add --reward-sync-in-thread to time them out (or make them async)",
                    options.timeout_s, ", ".join(inline))
