"""The pool of --partial-rollouts (rlhf/runtime/rl/offpolicy/partial.py): one policy copy per live
version, made when the run starts (K + 1 at most), a retired version's copy loaded with another,
engines that take one event loop at a time served from one of their own (offpolicy/served.py)
while the generation lanes' loops await them, cancellation reaching the served request."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlhf.core.errors import RlhfError
from rlhf.runtime.rl.offpolicy.partial import VersionPool, capacity
from rlhf.runtime.rl.offpolicy.served import ServedEngine

pytestmark = pytest.mark.unit


class Engine:
    """``generate_one`` records the event loop and thread it runs on; ``gate`` holds it until set."""

    def __init__(self, many_event_loops=None):
        if many_event_loops is not None:
            self.many_event_loops = many_event_loops
        self.calls, self.cancelled = [], []
        self.gate = threading.Event()
        self.gate.set()

    async def generate_one(self, prompt_ids, params, **options):
        self.calls.append((list(prompt_ids), params, options, asyncio.get_running_loop(),
                           threading.current_thread().name))
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            self.cancelled.append(list(prompt_ids))
            raise
        return f"done {prompt_ids}"


class Copy:
    def __init__(self, engine):
        self.loaded, self.closed = [], False
        self.rollout = type("Rollout", (), {"engine": engine})()

    def load(self, snapshot):
        self.loaded.append(snapshot)

    def close(self):
        self.closed = True


def pool(size, many_event_loops=None):
    made = []

    def make_copy():
        made.append(Copy(Engine(many_event_loops)))
        return made[-1]

    return VersionPool(make_copy, lambda version: f"weights {version}", size), made


def test_capacity_is_the_versions_batches_in_flight_may_need_at_once():
    assert [capacity(k) for k in range(6)] == [1, 2, 3, 4, 5, 6]


def test_the_copies_are_made_at_the_start_and_a_retired_version_s_copy_takes_the_next():
    versions, made = pool(2)
    assert len(made) == 2 and all(not c.loaded for c in made)  # made, nothing loaded yet
    first = versions.get(3)
    assert first.loaded == ["weights 3"] and versions.get(3) is first and first.loaded == ["weights 3"]
    second = versions.get(4)
    assert second is not first and second.loaded == ["weights 4"]
    with pytest.raises(RlhfError, match=r"policy version 5 is needed while versions \[3, 4\] are still in use, "
                                        r"more than the 2 the staleness bound allows"):
        versions.get(5)
    versions.retire(4)  # no batch in flight starts before version 4
    assert versions.get(5) is first and first.loaded == ["weights 3", "weights 5"]
    assert versions.get(4) is second and second.loaded == ["weights 4"]
    versions.retire(4)  # nothing below 4 left: nothing changes
    assert versions.get(5) is first and len(first.loaded) == 2
    versions.close()
    assert all(c.closed for c in made)


def test_an_engine_that_takes_one_event_loop_is_served_from_a_thread_of_its_own_once_per_copy():
    versions, made = pool(2)
    served = versions.engine(0)
    assert isinstance(served, ServedEngine) and served.engine is versions.get(0).rollout.engine is made[0].rollout.engine
    assert versions.engine(0) is served  # one server per copy
    assert versions.engine(1) is not served
    shared, _ = pool(1, many_event_loops=True)
    assert shared.engine(0) is shared.get(0).rollout.engine  # a decode batch per event loop: called directly
    versions.close()
    assert not served.thread.is_alive()


def test_lanes_event_loops_share_one_served_loop_and_get_their_answers():
    engine = Engine()
    served = ServedEngine(engine)
    answers = {}

    def lane(name):
        answers[name] = asyncio.run(served.generate_one([name], "params", top_logprobs=2))

    threads = [threading.Thread(target=lane, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    served.close()
    assert answers == {1: "done [1]", 2: "done [2]"}
    loops = {call[3] for call in engine.calls}
    assert loops == {served.loop} and {call[4] for call in engine.calls} == {"rlhf-served-engine"}
    assert all(call[1:3] == ("params", {"top_logprobs": 2}) for call in engine.calls)
    assert not served.thread.is_alive()


def test_cancelling_a_lane_s_call_cancels_the_served_request():
    engine = Engine()
    engine.gate.clear()  # the request runs until cancelled
    served = ServedEngine(engine)

    async def lane():
        task = asyncio.ensure_future(served.generate_one([7], None))
        while not engine.calls:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(lane())
    for _ in range(1000):
        if engine.cancelled:
            break
        threading.Event().wait(0.005)
    served.close()
    assert engine.cancelled == [[7]]


def test_a_batch_leaving_the_flight_frees_the_copies_of_versions_before_the_oldest_batch_left():
    """K = 2, three copies: batch 4 (from version 2) computes its behaviour log-probs while batch 6
    (from 4) waits for version 5, which the trainer publishes once batch 4 trained: batch 4 leaving
    the flight frees versions 2 and 3 then, not when the next batch starts."""
    from types import SimpleNamespace

    from rlhf.runtime.rl.async_generation import AsyncGeneration

    versions, made = pool(capacity(2))
    producer = SimpleNamespace(cond=threading.Condition(), rolling={}, schedule=object(), pool=versions)
    producer._in_flight = lambda step, version: AsyncGeneration._in_flight(producer, step, version)
    producer._in_flight(4, 2)
    producer._in_flight(6, 4)
    held = [versions.get(v) for v in (2, 3, 4)]
    with pytest.raises(RlhfError):
        versions.get(5)
    AsyncGeneration._rolled_out(producer, 4)
    assert producer.rolling == {6: 4}
    assert versions.get(5) in held[:2] and versions.get(4) is held[2]
    AsyncGeneration._rolled_out(producer, 6)  # the last batch in flight: its copies stay for the next
    assert versions.get(4) is held[2]
