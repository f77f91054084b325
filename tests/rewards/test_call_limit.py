"""CallLimit: a source's calls in flight stay within its concurrency option over every batch being
scored, each batch on an event loop of its own (a pipelined --async run)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.threads import CallLimit

pytestmark = pytest.mark.unit


def test_a_call_limit_holds_across_event_loops_and_threads():
    limit, lock = CallLimit(3), threading.Lock()
    state = {"now": 0, "most": 0, "done": 0}

    async def one() -> None:
        async with limit:
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            await asyncio.sleep(0.01)
            with lock:
                state["now"] -= 1
                state["done"] += 1

    async def batch() -> None:
        await asyncio.gather(*(one() for _ in range(10)))

    threads = [threading.Thread(target=asyncio.run, args=(batch(),)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert state == {"now": 0, "most": 3, "done": 40}
    assert limit.held == 0


def test_a_cancelled_waiter_gives_its_turn_on():
    limit = CallLimit(1)

    async def main() -> None:
        await limit.__aenter__()
        waiter = asyncio.ensure_future(limit.__aenter__())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await limit.__aexit__()
        async with limit:  # free again
            assert limit.held == 1

    asyncio.run(main())
    assert limit.held == 0


def test_a_reward_functions_calls_stay_within_its_concurrency_over_batches_scored_at_once():
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    async def slow(completion, **kwargs):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        await asyncio.sleep(0.01)
        with lock:
            state["now"] -= 1
        return 1.0

    reward = FunctionSource(slow, "slow", "test", RewardOptions(async_concurrency=2))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(reward.score(["p"] * 6, ["c"] * 6)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [[1.0] * 6] * 3
    assert state["most"] == 2
