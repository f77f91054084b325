"""Continuous batching for the ``vllm`` engine: one request per call, stepped through vLLM's own engine.

`RequestBatch` holds the requests that ``VLLMEngine.generate_one`` calls of one event loop have in
flight, and one asyncio task that steps vLLM's engine while any are. A request enters vLLM's
scheduler when its call is made (``llm_engine.add_request``), so it is decoded at the next step
together with every other request in flight, and its call returns as soon as vLLM reports it
finished: a multi-turn trajectory's next turn does not wait for the other trajectories' turns.

**Why the ``LLM`` object's engine, stepped here, and not vLLM's ``AsyncLLM``.** ``AsyncLLM`` runs
its engine core in a process of its own (0.10.2-0.33 have no in-process asynchronous client), so
a weight sync would pickle every tensor through ``collective_rpc`` and a second engine would
need a second copy of the weights and KV cache on the GPU. The ``LLM`` object the engine already
holds runs its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): stepping its
``llm_engine`` by hand (``add_request`` / ``step`` / ``abort_request``, the calls ``LLM.generate``
makes itself, present from 0.10.2 to 0.33) keeps one engine for ``generate``,
``generate_one``, weight sync, sleep and wake.

**Threads.** Everything runs on the event loop's thread: ``add_request`` and ``abort_request`` in
the calling coroutine, ``step()`` in the stepping task, which yields to the loop after each step
so that the trajectories its outputs woke can submit their next turn before the next step. No
call into vLLM ever overlaps another. A step blocks the loop while it runs (a decode step, tens
of milliseconds): environment calls that run in worker threads go on meanwhile, coroutines wait
for the step's end.

**Ids.** vLLM 0.10.2 keeps the request id it is given; later releases may add a suffix of their
own and return the id they use (``add_request``'s return value). Outputs are matched under both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class RequestBatch:
    """The in-flight requests of one event loop, and the task that steps ``llm_engine`` for them.

    ``on_idle`` runs once the last request in flight has ended and the trajectories it woke have
    had their turn to submit the next one (the engine sleeps there under ``auto_sleep``); not
    after a failed step.
    """

    def __init__(self, llm_engine: Any, *, on_idle: Callable[[], None]):
        self.llm_engine = llm_engine
        self.loop = asyncio.get_running_loop()
        self.on_idle = on_idle
        self.waiting: dict[str, asyncio.Future] = {}  # our request id -> the future of its final output
        self.ours: dict[str, str] = {}  # vLLM's id for a request, when it differs -> ours
        self.listeners: dict[str, Callable[[Any], None]] = {}  # our id -> what takes its partial outputs
        self.idle = asyncio.Event()
        self.idle.set()
        self.task: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self.waiting)

    async def run(self, request_id: str, prompt_ids: list[int], sampling: Any,
                  on_output: Callable[[Any], None] | None = None) -> Any:
        """Add one request to vLLM's engine and wait for its final ``RequestOutput``. An error or a
        cancellation of the waiting coroutine aborts the request in vLLM before it propagates.
        ``on_output``: called with the request's completion output at every step that reports one
        (a request sampled with a streaming output kind), the final one included."""
        if request_id in self.waiting:
            raise RuntimeError(f"vllm engine: request id {request_id} is already in flight")
        future = self.loop.create_future()
        used = self.llm_engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, sampling)
        self.waiting[request_id] = future
        if on_output is not None:
            self.listeners[request_id] = on_output
        if isinstance(used, str) and used != request_id:
            self.ours[used] = request_id
        self.idle.clear()
        if self.task is None or self.task.done():
            self.task = self.loop.create_task(self._step_while_busy())
        try:
            return await future
        except BaseException:
            self.abort([request_id])
            raise
        finally:
            self.listeners.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        """Stop the requests still in flight among ``request_ids`` (vLLM frees their KV cache)."""
        live = [rid for rid in request_ids if self.waiting.pop(rid, None) is not None]
        if not live:
            return
        self.llm_engine.abort_request(live)
        self.ours = {used: rid for used, rid in self.ours.items() if rid not in live}
        log.debug("vllm engine: aborted %s", live)

    def abandon(self, error: BaseException | None = None) -> None:
        """Abort everything in flight; the waiting calls fail with ``error`` (else are cancelled)."""
        futures = list(self.waiting.values())
        self.abort(list(self.waiting))
        for future in futures:
            if not future.done():
                future.set_exception(error) if error is not None else future.cancel()

    async def _step_while_busy(self) -> None:
        try:
            while self.waiting:
                outputs = self.llm_engine.step()
                for output in outputs:
                    finished = getattr(output, "finished", True)
                    rid = self.ours.get(output.request_id, output.request_id)
                    listener = self.listeners.get(rid)
                    if listener is not None and rid in self.waiting:
                        listener(output.outputs[0])
                    if not finished:
                        continue  # a partial output: only requests that stream ask for them
                    self.ours.pop(output.request_id, None)
                    future = self.waiting.pop(rid, None)
                    if future is not None and not future.done():
                        future.set_result(output)
                await asyncio.sleep(0)  # the woken trajectories run; their next turns join the next step
        except asyncio.CancelledError:  # the loop is closing: nothing may stay in vLLM
            self.abandon()
            self.idle.set()
            raise
        except Exception as error:  # a failed step fails every request in flight
            log.debug("vllm engine: a step failed; aborting %d requests", len(self.waiting))
            self.abandon(error)
            self.idle.set()
            return
        self.idle.set()
        self.on_idle()
