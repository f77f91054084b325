"""A rollout tells its caller when it has drawn the last number it draws from the process's random stream.

torch's default generator is one stream for the whole process: runs are reproducible only if
its numbers are drawn in the same order every time. ``--async`` with several generation lanes
(`rlhf.runtime.rl.async_generation`) therefore lets one batch's rollout draw at a time, in step
order. A turn-batched rollout draws while it decodes, so the next batch's rollout starts when
it returns. A continuously batched one draws a single seed at its start and samples every
request from a stream of its own (`rlhf.runtime.rl.rollout`): it calls `random_draws_done` then,
and the next batch's rollout may start while this one still waits on its tool calls.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_local = threading.local()


@contextlib.contextmanager
def ordered_draws(done: Callable[[], None]) -> Iterator[None]:
    """Run a rollout in this thread; ``done`` is called when it says it draws nothing more (at
    most once, and not at all when it never says so: the caller then treats its return as the end)."""
    _local.done = done
    try:
        yield
    finally:
        _local.done = None


def random_draws_done() -> None:
    """This thread's rollout draws nothing more from the process's random stream."""
    done = getattr(_local, "done", None)
    if done is not None:
        _local.done = None
        done()
