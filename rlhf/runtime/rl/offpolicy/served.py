"""An engine that several event loops share, served from an event loop of its own (--partial-rollouts).

The generation lanes each run their batch's rollout in an event loop of their own, and with partial
rollouts they share the engine of each policy version (`rlhf.runtime.rl.offpolicy.partial.VersionPool`).
An engine's ``generate_one`` batches the requests of the event loop it is awaited in; the ``hf``
engine keeps a decode batch per loop and declares ``many_event_loops``, but an engine that steps one
scheduler of its own (vLLM's ``llm_engine``: rlhf/plugins/engines/vllm_continuous.py) may be
stepped from one loop only. `ServedEngine` runs such an engine's ``generate_one`` calls on a thread
with one event loop of its own: every lane's requests to that version join its one running batch,
its weight syncs run there between requests, and a lane's call waits for its request's answer
without blocking the lane's loop. Cancelling the lane's call cancels the request there (the engine
aborts it)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

STOP_TIMEOUT_S = 10.0


class ServedEngine:
    """``engine.generate_one``, awaited from any event loop, run on this object's own."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rlhf-served-engine", daemon=True)
        self.thread.start()

    async def generate_one(self, prompt_ids: list[int], params: Any, **options: Any) -> Any:
        running = asyncio.run_coroutine_threadsafe(self.engine.generate_one(prompt_ids, params, **options), self.loop)
        return await asyncio.wrap_future(running)

    def close(self) -> None:
        """Stop the loop's thread (requests still in flight there are left to the engine)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(STOP_TIMEOUT_S)
