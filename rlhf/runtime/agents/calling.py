"""Calling an agent: sync or ``async``, bounded by ``--agent.timeout-s``, every failure caught.

An ``async`` agent runs on the rollout's event loop; a sync one in a daemon thread of its own (a
thread that hangs cannot be stopped: the call is abandoned at the timeout, its endpoint closed so
whatever it sends later is refused, and the thread ends with the process). The result is a
`Called`: the agent's `AgentResult`, or the outcome of a failure (``agent_error``, ``timeout``) and
its error's first line.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import dataclass
from typing import Any

from rlhf.core.protocols.agent import AgentConfig, AgentResult, Endpoint, as_agent_result


@dataclass(frozen=True)
class Called:
    result: AgentResult | None  # None when the call failed
    outcome: str = "ok"  # ok, agent_error or timeout
    error: str | None = None  # the failure's first line


class AgentCaller:
    """Calls ``solve(sample, endpoint)`` (or ``solve(sample, endpoint, config)``) as the run asks."""

    def __init__(self, solve: Any, config: AgentConfig, name: str):
        self.solve, self.config, self.name = solve, config, name
        target = inspect.unwrap(solve.__call__ if not inspect.isroutine(solve) and callable(solve) else solve)
        self.is_async = inspect.iscoroutinefunction(target)
        self.takes_config = _positional_count(solve) >= 3

    async def __call__(self, sample: dict[str, Any], endpoint: Endpoint) -> Called:
        args = (sample, endpoint, self.config) if self.takes_config else (sample, endpoint)
        timeout = self.config.timeout_s
        try:
            if self.is_async:
                value = await asyncio.wait_for(self.solve(*args), timeout)
            else:
                value = await asyncio.wait_for(_in_thread(self.solve, args), timeout)
            if inspect.isawaitable(value):  # a sync callable that returned a coroutine
                value = await asyncio.wait_for(value, timeout)
            return Called(as_agent_result(value))
        except asyncio.TimeoutError:
            return Called(None, "timeout", f"the agent {self.name!r} took longer than --agent.timeout-s "
                                           f"({timeout:g} s)")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an agent's failure is its trajectory's outcome
            return Called(None, "agent_error", first_line(f"{type(exc).__name__}: {exc}"))


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:500]


def _positional_count(fn: Any) -> int:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def _in_thread(fn: Any, args: tuple) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread of its own; a future of the loop that resolves with it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter: Any, value: Any) -> None:
        if not future.done():
            setter(value)

    def hand_over(setter: Any, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(settle, setter, value)
        except RuntimeError:  # the loop is gone: the call was abandoned at its timeout
            pass

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            hand_over(future.set_exception, exc)
        else:
            hand_over(future.set_result, value)

    threading.Thread(target=run, name="rlhf-agent", daemon=True).start()
    return future
