"""Running blocking work next to an event loop, and event loops next to blocking work.

Both helpers use daemon threads rather than an executor: a reward call that never returns is
abandoned after its timeout, and a daemon thread cannot keep the process alive at exit (an
executor's worker threads are joined at interpreter shutdown, so one stuck verifier would hang it).
Within a `ThreadSlots` context (``rlhf reward serve --sync-in-thread``) the number of such threads
is bounded: a call waits for a free slot, and once every slot is held by a call that was abandoned
and never returned, new calls fail with `ThreadsExhausted` instead of starting more threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class CallLimit:
    """At most ``size`` holders at once across threads and event loops (``async with limit:``).

    An ``asyncio.Semaphore`` belongs to one loop, and every sync ``score`` call runs its own loop:
    a pipelined run (``--async``, docs/async.md) scores several batches at once, each on its loop,
    and this keeps a source's calls in flight within its concurrency option over all of them.
    Waiters are served first come, first served."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a call limit must be >= 1, got {size}")
        self.size, self.held = size, 0
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.held < self.size and not self._waiters:
                self.held += 1
                return
            granted: asyncio.Future = loop.create_future()
            self._waiters.append((loop, granted))
        try:
            await granted
        except asyncio.CancelledError:
            with self._lock:
                if (loop, granted) in self._waiters:
                    self._waiters.remove((loop, granted))
                    raise
            self._release()  # granted while being cancelled: hand the slot on
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        with self._lock:
            while self._waiters:
                loop, granted = self._waiters.pop(0)
                try:
                    loop.call_soon_threadsafe(_grant, granted)  # the slot passes to it: `held` stays
                    return
                except RuntimeError:  # that loop has closed: nobody waits there any more
                    continue
            self.held -= 1


def _grant(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class ThreadsExhausted(RuntimeError):
    """Every thread slot is held by an abandoned call that has not returned."""


class ThreadSlots:
    """At most ``size`` threads for `run_in_thread` calls made under `use` (one event loop's)."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"thread slots must be >= 1, got {size}")
        self.size = size
        self.busy = 0  # threads running, abandoned ones included
        self.abandoned = 0  # threads whose caller stopped waiting (timeout, cancel) and that still run
        self._lock = threading.Lock()
        self._freed: asyncio.Event | None = None

    @property
    def exhausted(self) -> bool:
        return self.abandoned >= self.size

    def use(self) -> contextvars.Token:
        """Route this task's (and its children's) `run_in_thread` calls through these slots."""
        return _slots.set(self)

    async def acquire(self) -> None:
        while True:
            if self.exhausted:
                raise ThreadsExhausted(f"all {self.size} reward threads are stuck in calls that never returned")
            with self._lock:
                if self.busy < self.size:
                    self.busy += 1
                    return
            if self._freed is None:
                self._freed = asyncio.Event()
            self._freed.clear()
            await self._freed.wait()

    def release(self, loop: asyncio.AbstractEventLoop, abandoned: bool) -> None:
        """Called from the worker thread when its call returns."""
        with self._lock:
            self.busy -= 1
            self.abandoned -= abandoned
        if self._freed is not None:
            try:
                loop.call_soon_threadsafe(self._freed.set)
            except RuntimeError:  # the loop has closed
                pass


_slots: contextvars.ContextVar[ThreadSlots | None] = contextvars.ContextVar("rlhf_reward_thread_slots", default=None)


async def run_in_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Await ``fn(*args, **kwargs)`` run in a new daemon thread (cancelling stops the wait, not the thread)."""
    loop = asyncio.get_running_loop()
    slots = _slots.get()
    if slots is not None:
        await slots.acquire()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()
    state = {"abandoned": False}

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def target() -> None:
        try:
            outcome = (True, context.run(fn, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            outcome = (False, exc)
        if slots is not None:
            with slots._lock:
                abandoned = state["abandoned"]
                state["abandoned"] = None  # returned: a late cancel no longer counts it
            slots.release(loop, bool(abandoned))
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed while we ran: nobody waits for us any more
            pass

    threading.Thread(target=target, daemon=True, name=f"rlhf-reward-{getattr(fn, '__name__', 'call')}").start()
    try:
        return await future
    except asyncio.CancelledError:
        if slots is not None:
            with slots._lock:
                if state["abandoned"] is False:  # still running: it keeps its slot until it returns
                    state["abandoned"] = True
                    slots.abandoned += 1
        raise


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
