"""The environment contract (docs/environments.md) and the host-side helpers the rollout loop uses.

An environment drives one trajectory. The runtime creates an instance per trajectory
(``env_cls()``, or ``env_cls(config)`` when it was registered with a ``config_cls``), then::

    observation = env.reset(prompt, label, **columns)   # str appended after the prompt, or None
    loop over model turns (first turn stops at env.stop):
        result = env.step(action_text)                   # StepResult(observation, reward, done, info, stop)
        append result.observation (loss mask 0); stop at --max-turns, the token budget or result.done
    env.close()                                          # when defined

* ``prompt`` is the prompt as the dataset gave it (string or chat messages); ``label`` is the
  label column (a dict when routed by ``env_func``, below); ``columns`` are the other dataset
  columns, passed by name: only those ``reset`` declares, or all when it takes ``**columns``.
* ``action_text`` is this turn's decoded text (no special tokens), *including* the stop string
  that ended the turn; engines that strip it add it back. The env only reads it.
* ``StepResult.stop``: stop strings for the next turn, on top of EOS and the run's own; ``None``:
  none from the env. The optional class attribute ``stop`` gives those of the first turn.
* The trajectory reward is the sum of step rewards plus the reward sources'. ``info`` dicts are
  kept with the trajectory.
* ``reset``, ``step`` and ``close`` may each be ``async def``. Sync ``reset`` and ``step`` run in a
  worker thread, so the environments of a batch step concurrently; an environment whose methods
  are cheap (no I/O, no waiting) sets the class attribute ``blocking = False`` and they run
  inline, without the thread hop (the default single-turn environment does).
* Environment classes must be importable by module path (Ray workers import them).
* Optional class attributes for ``rlhf plugins check``: ``sample_actions`` (scripted model turns),
  ``sample_prompt``, ``sample_label``.
* The optional members (``stop``, ``blocking``, ``close``) are read from the class once, where it
  is resolved (`EnvDeclarations`), never probed on an instance.

Per-sample routing: a label that is a dict, or a string holding a JSON object, with an
``env_func`` key runs the environment it names (a registered name or ``module:Class``) instead
of ``--env``; that environment receives the label parsed into a dict, ``env_func`` included.
Other labels are passed through untouched (a JSON string without ``env_func`` stays a string).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import pickle
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.contracts import declared, declares
from rlhf.core.types import StepResult

ENV_FUNC_KEY = "env_func"
SAMPLE_PROMPT = "What is 6 times 7?"
SAMPLE_LABEL = "42"
GENERIC_ACTIONS = ("The answer is 42.",)


class EnvContractError(RlhfError):
    """An environment returned something the contract does not allow, or raised."""


@runtime_checkable
class Environment(Protocol):
    """What an environment provides; see the module docstring for the full contract."""

    def reset(self, prompt: Any, label: Any, **columns: Any) -> str | None | Awaitable[str | None]: ...

    def step(self, action_text: str) -> StepResult | Awaitable[StepResult]: ...


async def call_maybe_async(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; await the result when it is awaitable (``async def`` or a returned coroutine)."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


async def call_in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``call_maybe_async``, with a plain (blocking) function run in a worker thread, so the
    environments of a batch step concurrently: one slow tool call does not hold up the others."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


def route_env(label: Any, default: str) -> tuple[str, Any]:
    """``(env name, label for the env)``: the label's ``env_func`` when it has one, else ``default``."""
    parsed = label
    if isinstance(label, (str, bytes)):
        text = label.strip()
        if not text.startswith("{" if isinstance(text, str) else b"{"):
            return default, label
        try:
            parsed = json.loads(text)
        except ValueError:
            return default, label
    if not isinstance(parsed, Mapping) or ENV_FUNC_KEY not in parsed:
        return default, label
    name = parsed[ENV_FUNC_KEY]
    if not isinstance(name, str) or not name.strip():
        raise EnvContractError(
            f"the label's {ENV_FUNC_KEY!r} must name an environment (a registered name or module:Class), "
            f"got {name!r}"
        )
    return name.strip(), dict(parsed)


def create_env(env_cls: Any, config: Any = None) -> Any:
    """One environment instance for one trajectory."""
    return env_cls() if config is None else env_cls(config)


@dataclass(frozen=True)
class EnvDeclarations:
    """The optional members an environment class declares, read once per class (`declared`).

    ``stop``: the first turn's stop strings (class attribute ``stop``); ``blocking``: False when
    the class sets ``blocking = False`` (its methods run inline, not in a worker thread);
    ``closes``: it defines ``close()``.
    """

    stop: tuple[str, ...] | None = None
    blocking: bool = True
    closes: bool = False

    @classmethod
    def of(cls, env_cls: type) -> EnvDeclarations:
        return _declarations(env_cls)


@lru_cache(maxsize=256)
def _declarations(env_cls: type) -> EnvDeclarations:
    stop = _check_stop(declared(env_cls, "stop"), f"{env_cls.__qualname__}.stop")
    return EnvDeclarations(stop=None if stop is None else tuple(stop),
                           blocking=declared(env_cls, "blocking", True) is not False,
                           closes=declares(env_cls, "close"))


class AsyncEnv:
    """Any environment seen through one async interface, its results checked against the contract.

    ``declarations``: what its class declares (`EnvDeclarations.of`, read once per class by the
    caller that resolved it; read here from ``type(env)`` when not given)."""

    def __init__(self, env: Any, name: str | None = None, declarations: EnvDeclarations | None = None):
        if not isinstance(env, Environment):
            raise EnvContractError(f"{type(env).__qualname__} is not an environment: it needs reset() and step()")
        self.env = env
        self.name = name or type(env).__qualname__
        self.declarations = declarations or EnvDeclarations.of(type(env))
        self.call = call_in_thread if self.declarations.blocking else call_maybe_async

    @property
    def stop(self) -> list[str] | None:
        """Stop strings for the first turn (the class's ``stop`` attribute)."""
        return None if self.declarations.stop is None else list(self.declarations.stop)

    async def reset(self, prompt: Any, label: Any, columns: Mapping[str, Any] | None = None) -> str | None:
        kwargs = _declared(self.env.reset, columns or {})
        observation = await self.call(self.env.reset, prompt, label, **kwargs)
        if observation is not None and not isinstance(observation, str):
            raise EnvContractError(
                f"{self.name}.reset must return the text to append after the prompt (a str) or None, "
                f"got {type(observation).__name__}"
            )
        return observation

    async def step(self, action_text: str) -> StepResult:
        return as_step_result(await self.call(self.env.step, action_text), f"{self.name}.step")

    async def close(self) -> None:
        if self.declarations.closes:
            await call_maybe_async(self.env.close)


def _declared(fn: Any, columns: Mapping[str, Any]) -> dict[str, Any]:
    """The columns ``fn`` declares (all of them when it takes ``**kwargs``); never prompt/label."""
    columns = {k: v for k, v in columns.items() if k not in ("prompt", "label")}
    function = getattr(fn, "__func__", None)  # a bound method: its function, read once per class
    try:
        names = _keyword_names(function, True) if function is not None else _keyword_names(fn, False)
    except TypeError:  # unhashable callable
        names = _keyword_names.__wrapped__(fn, False)
    if names is None:
        return dict(columns)
    return {k: v for k, v in columns.items() if k in names}


@lru_cache(maxsize=1024)
def _keyword_names(fn: Any, bound: bool) -> frozenset[str] | None:
    """The names ``fn`` takes by keyword (less its first parameter when ``bound``: a method's
    self); None when it takes ``**kwargs`` or has no readable signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if bound and params and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
        params = params[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params
                     if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def as_step_result(obj: Any, who: str = "step") -> StepResult:
    """Check a step's return value (a StepResult, or a dict of its fields) and normalise it."""
    if isinstance(obj, Mapping):
        unknown = set(obj) - {"observation", "reward", "done", "info", "stop"}
        if unknown:
            raise EnvContractError(f"{who} returned a dict with unknown key(s) {sorted(unknown)}; return a StepResult")
        obj = StepResult(**obj)
    if not isinstance(obj, StepResult):
        raise EnvContractError(f"{who} must return rlhf.core.types.StepResult, got {type(obj).__name__}")
    if not isinstance(obj.observation, str):
        raise EnvContractError(f"{who}: StepResult.observation must be a str, got {type(obj.observation).__name__}")
    try:
        reward = float(obj.reward)
    except (TypeError, ValueError):
        raise EnvContractError(f"{who}: StepResult.reward must be a number, got {obj.reward!r}") from None
    if not math.isfinite(reward):
        raise EnvContractError(f"{who}: StepResult.reward must be finite, got {reward}")
    if not isinstance(obj.done, (bool, int)) and type(obj.done).__name__ != "bool_":
        raise EnvContractError(f"{who}: StepResult.done must be a bool, got {type(obj.done).__name__}")
    if not isinstance(obj.info, dict):
        raise EnvContractError(f"{who}: StepResult.info must be a dict, got {type(obj.info).__name__}")
    return StepResult(observation=obj.observation, reward=reward, done=bool(obj.done), info=obj.info,
                      stop=_check_stop(obj.stop, f"{who}: StepResult.stop"))


def _check_stop(stop: Any, who: str) -> list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise EnvContractError(f"{who} must be None or a list of non-empty strings, got {stop!r}")
    return list(stop)


# --- rlhf plugins check ------------------------------------------------------------------------


def check_env(env_cls: Any, *, config: Any = None, name: str | None = None, max_turns: int = 8) -> list[str]:
    """Run a scripted episode through ``env_cls`` and check every contract rule on the way.

    Returns report lines; raises `EnvContractError` at the first violation (or exception).
    """
    name = name or getattr(env_cls, "__qualname__", repr(env_cls))
    lines = []
    try:
        same = pickle.loads(pickle.dumps(env_cls)) is env_cls
    except Exception as exc:  # noqa: BLE001 - reported as the finding
        raise EnvContractError(f"{name} cannot be pickled by reference (Ray workers import it): {exc}") from exc
    if not same:
        raise EnvContractError(f"{name} does not unpickle to the same class; define it at module level")
    lines.append("class is importable and picklable by reference")
    return lines + asyncio.run(_scripted_episode(env_cls, config, name, max_turns))


async def _scripted_episode(env_cls: Any, config: Any, name: str, max_turns: int) -> list[str]:
    lines = []

    async def attempt(what: str, call: Any) -> Any:
        try:
            return await call
        except EnvContractError:
            raise
        except Exception as exc:
            raise EnvContractError(f"{name}.{what} raised {type(exc).__name__}: {exc}") from exc

    try:
        env = AsyncEnv(create_env(env_cls, config), name)
    except EnvContractError:
        raise
    except Exception as exc:
        raise EnvContractError(f"creating {name} raised {type(exc).__name__}: {exc}") from exc
    lines.append(f"created {name}{'(config)' if config is not None else '()'}; first-turn stop: {env.stop!r}")
    prompt = declared(env_cls, "sample_prompt", SAMPLE_PROMPT)
    label = declared(env_cls, "sample_label", SAMPLE_LABEL)
    actions = list(declared(env_cls, "sample_actions") or GENERIC_ACTIONS)
    observation = await attempt("reset", env.reset(prompt, label, {}))
    lines.append(f"reset({prompt!r}, {label!r}) -> {_short(observation)}")
    for turn in range(1, max_turns + 1):
        action = actions[min(turn - 1, len(actions) - 1)]
        result = await attempt("step", env.step(action))
        lines.append(f"step {turn}: {_short(action)} -> observation {_short(result.observation)}, "
                     f"reward {result.reward:g}, done {result.done}, stop {result.stop!r}")
        if result.done:
            await attempt("close", env.close())
            lines.append(f"episode ended after {turn} turn(s)")
            return lines
    raise EnvContractError(f"{name} did not end the scripted episode within {max_turns} turns "
                           "(give the class sample_actions that finish an episode)")


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."
