"""Python reward functions, called by signature so functions written for OpenRLHF, TRL and verl run
unchanged (docs/rewards.md).

A function receives only the parameters it declares (plus everything else through ``**kwargs``):

=================  =======================================================================
batched inputs     ``prompts``, ``completions``, ``labels``, ``queries``, ``completion_ids``
                   and every dataset column by its name (lists of length B)
per-sample inputs  ``prompt``, ``completion``, ``label``, ``query``, ``completion_ids``,
                   verl's ``solution_str`` (completion), ``ground_truth`` (label),
                   ``data_source`` (that column, or "default") and ``extra_info`` (the row's
                   ``extra_info`` column when it is a dict, else the row's columns), and every
                   column by name (one value)
=================  =======================================================================

A function is per-sample when it declares a per-sample input (``prompt``, ``completion``,
``label``, ``query``, ``solution_str``, ``ground_truth``) and batched otherwise; a registration's
``batched=`` flag overrides the guess. Deviations kept for compatibility: batched ``completions``
are strings for plain-text prompts and ``[{"role": "assistant", "content": ...}]`` for chat prompts
(TRL); batched ``prompts`` are the templated prompt texts when the function also declares
``queries`` (OpenRLHF, where each query starts with its prompt) and the dataset prompts otherwise.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf.rewards.failures import RewardConfigError
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.returns import BadReturn, batched_return, sample_return, to_number
from rlhf.rewards.source import RewardBatch, RewardSource, SourceOutput
from rlhf.rewards.threads import CallLimit, run_in_thread, run_sync

BATCH_MARKERS = ("prompts", "completions", "labels", "queries")
SAMPLE_MARKERS = ("prompt", "completion", "label", "query", "solution_str", "ground_truth")
LABEL_INPUTS = ("labels", "label", "ground_truth")  # a function declaring one (without a default) compares with labels


@dataclass(frozen=True)
class CallPlan:
    params: tuple[inspect.Parameter, ...]  # named parameters, in order (no *args / **kwargs)
    var_keyword: bool  # declares **kwargs
    batched: bool
    is_async: bool

    @property
    def names(self) -> set[str]:
        return {p.name for p in self.params}


def plan_call(fn: Callable[..., Any], where: str, *, batched: bool | None = None,
              is_async: bool | None = None) -> CallPlan:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise RewardConfigError(f"cannot read the signature of reward function {where}: {exc}") from exc
    params = tuple(p for p in signature.parameters.values()
                   if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD))
    names = {p.name for p in params}
    plural, singular = names.intersection(BATCH_MARKERS), names.intersection(SAMPLE_MARKERS)
    if batched is None:
        if plural and singular:
            raise RewardConfigError(
                f"reward function {where} declares batch inputs ({', '.join(sorted(plural))}) and per-sample "
                f"inputs ({', '.join(sorted(singular))}); use one style, or register it with batched=True/False")
        batched = not singular
    if is_async is None:
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    return CallPlan(params=params, var_keyword=var_keyword, batched=bool(batched), is_async=bool(is_async))


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def batch_inputs(batch: RewardBatch, plan: CallPlan) -> dict[str, Any]:
    inputs: dict[str, Any] = dict(batch.columns)  # reserved names below win over same-named columns
    inputs.update(
        prompts=batch.prompt_texts if "queries" in plan.names else batch.prompts,
        completions=[[{"role": "assistant", "content": c}] if is_chat(p) else c
                     for p, c in zip(batch.prompts, batch.completions)],
        labels=batch.labels, queries=batch.queries)
    if batch.completion_ids is not None:
        inputs["completion_ids"] = batch.completion_ids
    return inputs


def sample_inputs(batch: RewardBatch, index: int) -> dict[str, Any]:
    row = batch.row(index)
    inputs: dict[str, Any] = dict(row)
    completion, label = batch.completions[index], batch.labels[index]
    inputs.update(
        prompt=batch.prompts[index], completion=completion, label=label,
        query=batch.prompt_texts[index] + completion, solution_str=completion, ground_truth=label,
        data_source=row["data_source"] if row.get("data_source") is not None else "default",
        extra_info=row["extra_info"] if isinstance(row.get("extra_info"), dict) else row)
    if batch.completion_ids is not None:
        inputs["completion_ids"] = batch.completion_ids[index]
    return inputs


class FunctionSource(RewardSource):
    """A Python function (sync or async, batched or per-sample) as a reward source."""

    kind = "function"

    def __init__(self, fn: Callable[..., Any], name: str, where: str, options: RewardOptions | None = None, *,
                 batched: bool | None = None, is_async: bool | None = None):
        super().__init__(name, where, options)
        self.fn = fn
        self.plan = plan_call(fn, where, batched=batched, is_async=is_async)
        self.limit = CallLimit(self.options.async_concurrency)  # calls in flight, over every batch being scored

    @property
    def inline(self) -> bool:
        return not self.plan.is_async and not self.options.sync_in_thread

    @property
    def label_inputs(self) -> list[str]:
        return [p.name for p in self.plan.params if p.name in LABEL_INPUTS and p.default is inspect.Parameter.empty]

    # --- arguments ----------------------------------------------------------------------------

    def bind(self, inputs: dict[str, Any], extras: dict[str, Any], columns: list[str]) -> tuple[list, dict]:
        """Positional and keyword arguments for one call; `RewardConfigError` for a missing input."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in self.plan.params:
            if p.name in inputs:
                value = inputs[p.name]
            elif p.default is not inspect.Parameter.empty:
                if p.kind is not inspect.Parameter.POSITIONAL_ONLY:
                    continue
                value = p.default
            else:
                kind = "batched" if self.plan.batched else "per-sample"
                reserved = sorted(set(inputs) - set(columns))
                raise RewardConfigError(
                    f"reward function {self.where} needs the argument {p.name!r}, which is neither a {kind} reward "
                    f"input ({', '.join(reserved)}) nor a dataset column ({', '.join(columns) or 'none'}). "
                    "Give the argument a default value, or add the column to the dataset.")
            if p.kind is inspect.Parameter.POSITIONAL_ONLY:
                args.append(value)
            else:
                kwargs[p.name] = value
        if self.plan.var_keyword:
            kwargs.update({k: v for k, v in extras.items() if k not in self.plan.names})
        return args, kwargs

    def calls(self, batch: RewardBatch) -> list[tuple[list, dict]]:
        """The arguments of every call this batch needs: one call (batched) or one per sample."""
        columns = sorted(batch.columns)
        if self.plan.batched:
            inputs = batch_inputs(batch, self.plan)
            return [self.bind(inputs, inputs, columns)]
        return [self.bind(sample_inputs(batch, i), batch.row(i), columns) for i in range(len(batch))]

    # --- calling ------------------------------------------------------------------------------

    def _call_sync(self, args: list, kwargs: dict) -> Any:
        result = self.fn(*args, **kwargs)
        if inspect.isawaitable(result):  # a sync function that hands back a coroutine
            return run_sync(lambda: result)
        return result

    async def _call_async(self, args: list, kwargs: dict) -> Any:
        async def call() -> Any:
            try:
                if self.plan.is_async:
                    result = self.fn(*args, **kwargs)
                else:
                    result = await run_in_thread(self.fn, *args, **kwargs)
                while inspect.isawaitable(result):
                    result = await result
            except asyncio.TimeoutError as exc:  # the function's own, not our deadline
                return _Raised(exc)
            return result

        try:
            result = await asyncio.wait_for(call(), self.options.timeout_s)
        except asyncio.TimeoutError:
            raise _TimedOut from None
        if isinstance(result, _Raised):
            raise result.exc
        return result

    def _score_inline(self, batch: RewardBatch) -> SourceOutput:
        outcomes: list[Any] = []
        for args, kwargs in self.calls(batch):
            try:
                outcomes.append(_Ok(self._call_sync(args, kwargs)))
            except Exception as exc:  # noqa: BLE001 - becomes a failure; the policy decides
                outcomes.append(exc)
        return self._output(batch, outcomes)

    async def _ascore(self, batch: RewardBatch) -> SourceOutput:
        calls = self.calls(batch)
        async def one(args: list, kwargs: dict) -> Any:
            async with self.limit:
                try:
                    return _Ok(await self._call_async(args, kwargs))
                except Exception as exc:  # noqa: BLE001 - asyncio.TimeoutError included
                    return exc

        return self._output(batch, await asyncio.gather(*(one(a, k) for a, k in calls)))

    # --- results ------------------------------------------------------------------------------

    def _output(self, batch: RewardBatch, outcomes: list[Any]) -> SourceOutput:
        n = len(batch)
        if self.plan.batched:
            (outcome,) = outcomes
            if isinstance(outcome, Exception):
                return self.fail_all(batch, *describe_exception(outcome, self.options.timeout_s))
            try:
                raw, scores, extra_logs = batched_return(outcome.value, n)
            except BadReturn as exc:
                return self.fail_all(batch, exc.reason, exc.message)
            output = SourceOutput(values=[None] * n, scores=scores, extra_logs=extra_logs)
        else:
            raw, output = [None] * n, SourceOutput(values=[None] * n)
            for i, outcome in enumerate(outcomes):
                if isinstance(outcome, Exception):
                    output.failures[i] = self.failure(batch, i, *describe_exception(outcome, self.options.timeout_s))
                    continue
                try:
                    raw[i], extras = sample_return(outcome.value)
                except BadReturn as exc:
                    output.failures[i] = self.failure(batch, i, exc.reason, exc.message)
                    continue
                for key, value in extras.items():
                    output.extra_logs.setdefault(key, []).append(value)
        for i, item in enumerate(raw):
            if i in output.failures:
                continue
            try:
                value = to_number(item)
            except ValueError as exc:
                output.failures[i] = self.failure(batch, i, "bad value", f"returned {exc}")
                continue
            if value is not None and not math.isfinite(value):
                output.failures[i] = self.failure(batch, i, "not finite", f"returned {value}")
                continue
            output.values[i] = value
        return output



def describe_exception(exc: Exception, timeout_s: float) -> tuple[str, str, str]:
    """``(reason, message, traceback)`` of a failed call."""
    if isinstance(exc, _TimedOut):
        return "timeout", f"no result after {timeout_s:g} s (--reward-timeout-s)", ""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "exception", f"{type(exc).__name__}: {exc}", tb


@dataclass(frozen=True)
class _Ok:
    value: Any


@dataclass(frozen=True)
class _Raised:
    exc: BaseException


class _TimedOut(Exception):
    """A call ran past ``timeout_s`` (kept apart from a TimeoutError the function raises itself)."""
