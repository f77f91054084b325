"""Running blocking work next to an event loop, and event loops next to blocking work.

Both helpers use daemon threads rather than an executor: a reward call that never returns is
abandoned after its timeout, and a daemon thread cannot keep the process alive at exit (an
executor's worker threads are joined at interpreter shutdown, so one stuck verifier would hang it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def run_in_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Await ``fn(*args, **kwargs)`` run in a new daemon thread (cancelling stops the wait, not the thread)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def target() -> None:
        try:
            outcome = (True, context.run(fn, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed while we ran: nobody waits for us any more
            pass

    threading.Thread(target=target, daemon=True, name=f"rlhf-reward-{getattr(fn, '__name__', 'call')}").start()
    return await future


def start_in_background(make: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
    """Run the coroutine ``make()`` in a fresh event loop on a daemon thread; return its future.

    Safe from any thread, including one that already runs a loop (Jupyter).
    """
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def target() -> None:
        try:
            future.set_result(asyncio.run(make()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    threading.Thread(target=target, daemon=True, name="rlhf-reward-loop").start()
    return future


def run_sync(make: Callable[[], Awaitable[T]]) -> T:
    """Run an awaitable to completion from sync code, wherever it is called from."""

    async def wrapper() -> T:
        return await make()

    return start_in_background(wrapper).result()
