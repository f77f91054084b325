"""The JSON body of a scoring request, read under limits so that its size in memory is bounded.

A body may hold at most ``ServerLimits.max_json_values`` JSON values (strings, numbers, objects,
arrays, wherever they are, unknown keys included), counted before the document is parsed: a parsed
value costs tens of bytes however short its text (``{}`` is 3 bytes of text, 64 of dict), so this
count, not the body's size, bounds what parsing allocates. Nesting is bounded by ``max_depth``.

`BodyParser` parses a body larger than ``IN_PROCESS_MAX_BYTES`` in a worker process: ``json.loads``
and the regular expression that counts values each hold the GIL for as long as they run (0.15 s and
0.25 s for 24 MB of short strings, longer on a busy machine), which would stall the server's event
loop and ``/health`` however many threads it had. The worker runs at a lower priority (nice
``WORKER_NICENESS``) and returns the batch pickled in slices of ``SLICE_SAMPLES`` samples, which the
event loop itself unpickles one per turn (under a millisecond each), serving other requests between them.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import warnings
from typing import TYPE_CHECKING, Any

from rlhf.rewards.source import RewardBatch

if TYPE_CHECKING:
    from rlhf.rewards.limits import ServerLimits

PROTOCOL_KEYS = ("query", "prompts", "labels")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


class BadRequest(Exception):
    pass


def count_json_values(text: str) -> int:
    """An upper bound of the values in a JSON document: separators and openings outside strings, plus one."""
    def structure(s: str) -> int:
        return s.count(",") + s.count("[") + s.count("{") + 1

    rough = structure(text)  # counts those inside strings too: exact enough when it is small
    return rough if rough <= 1 << 16 else structure(_STRING.sub("0", text))


def parse_body(raw: bytes, limits: ServerLimits) -> Any:
    """Parse a request body, refusing (`BadRequest`) too many values, too deep nesting or bad JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not UTF-8: {exc}") from None
    values = count_json_values(text)
    if values > limits.max_json_values:
        raise BadRequest(f"the body holds about {values} JSON values, more than {limits.max_json_values} "
                         f"({limits.json_values_per_sample} per sample of --max-samples {limits.max_samples}): "
                         "send smaller batches")
    try:
        data = json.loads(text)
    except RecursionError:
        raise BadRequest(f"JSON nested deeper than {limits.max_depth} levels (--max-depth)") from None
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    del text
    stack = [(data, 1)]
    while stack:  # iterative: the depth check itself cannot recurse
        value, depth = stack.pop()
        if depth > limits.max_depth:
            raise BadRequest(f"JSON nested deeper than {limits.max_depth} levels (--max-depth)")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (list, dict)))
    if isinstance(data, dict) and isinstance(data.get("query"), list) and len(data["query"]) > limits.max_samples:
        raise BadRequest(f"{len(data['query'])} samples in one request, more than {limits.max_samples} "
                         "(--max-samples): send smaller batches")
    return data


def batch_from_request(data: Any) -> RewardBatch:
    """The batch a parsed body asks to score; keys other than query, prompts and labels are ignored."""
    if not isinstance(data, dict) or not isinstance(data.get("query"), list):
        raise BadRequest('the body must be a JSON object with a "query" list (and optional "prompts", "labels")')
    queries = data["query"]
    n = len(queries)
    prompts = data.get("prompts")
    labels = data.get("labels")
    for key, value in (("prompts", prompts), ("labels", labels)):
        if value is not None and (not isinstance(value, list) or len(value) != n):
            raise BadRequest(f'"{key}" must be a list as long as "query" ({n})')
    if not all(isinstance(q, str) for q in queries) or (prompts and not all(isinstance(p, str) for p in prompts)):
        raise BadRequest('"query" and "prompts" must hold strings')
    prompts = prompts or [""] * n
    completions = [q[len(p):] if p and q.startswith(p) else q for q, p in zip(queries, prompts)]
    return RewardBatch(prompts=list(prompts), completions=completions, labels=labels or [None] * n,
                       prompt_texts=list(prompts))


IN_PROCESS_MAX_BYTES = 256 * 1024  # larger bodies are parsed in the worker process
SLICE_SAMPLES = 64  # samples per pickled slice the worker returns: under a millisecond to unpickle
WORKER_NICENESS = 10  # the worker yields the CPU to the event loop (and to everything else) on a busy machine


def parse_batch(raw: bytes, limits: ServerLimits) -> RewardBatch:
    """The batch a request body asks to score (`BadRequest` when it is not a valid one)."""
    return batch_from_request(parse_body(raw, limits))


def parse_batch_in_slices(raw: bytes, limits: ServerLimits) -> list[bytes]:
    """`parse_batch` in the worker process: the batch's prompts, completions and labels, pickled in slices."""
    batch = parse_batch(raw, limits)
    del raw
    return [pickle.dumps((batch.prompts[i:i + SLICE_SAMPLES], batch.completions[i:i + SLICE_SAMPLES],
                          batch.labels[i:i + SLICE_SAMPLES]), protocol=pickle.HIGHEST_PROTOCOL)
            for i in range(0, len(batch), SLICE_SAMPLES)]


def batch_from_slices(slices: list[bytes]) -> RewardBatch:
    prompts: list[Any] = []
    completions: list[str] = []
    labels: list[Any] = []
    while slices:
        some_prompts, some_completions, some_labels = pickle.loads(slices.pop(0))  # one short GIL hold each
        prompts += some_prompts
        completions += some_completions
        labels += some_labels
    return RewardBatch(prompts=prompts, completions=completions, labels=labels, prompt_texts=list(prompts))


async def batch_from_slices_on_loop(slices: list[bytes]) -> RewardBatch:
    """`batch_from_slices` on the event loop, one slice per turn: requests waiting on the loop are served
    between slices, and no other thread holds the GIL meanwhile (a thread doing this, descheduled by a
    loaded machine while it holds the GIL, stalled the loop for hundreds of milliseconds)."""
    prompts: list[Any] = []
    completions: list[str] = []
    labels: list[Any] = []
    slices.reverse()
    while slices:
        some_prompts, some_completions, some_labels = pickle.loads(slices.pop())
        prompts += some_prompts
        completions += some_completions
        labels += some_labels
        await asyncio.sleep(0)
    return RewardBatch(prompts=prompts, completions=completions, labels=labels, prompt_texts=list(prompts))


def follow_parent(parent: int) -> None:
    """In the worker: leave Ctrl-C to the server, run at a lower priority (`WORKER_NICENESS`: on a loaded
    machine the parse must not take the CPU from the server's event loop), and exit once the server is gone
    (killed, it cannot say so)."""
    import signal
    import threading
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(WORKER_NICENESS)
    except (AttributeError, OSError):  # not on POSIX, or not allowed: same priority as the server
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="rlhf-follow-parent").start()


class BodyParser:
    """Parses request bodies: small ones in a thread, large ones in one worker process started on first use."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self._executor: Any = None
        self._no_worker = False

    async def parse(self, raw: bytes) -> RewardBatch:
        loop = asyncio.get_running_loop()
        worker = self._worker() if len(raw) > IN_PROCESS_MAX_BYTES else None
        if worker is None:
            return await loop.run_in_executor(None, parse_batch, raw, self.limits)
        from concurrent.futures.process import BrokenProcessPool

        try:
            slices = await asyncio.wrap_future(worker.submit(parse_batch_in_slices, raw, self.limits))
        except BrokenProcessPool:
            self.close()
            raise WorkerFailed("the process parsing request bodies died (out of memory?); retry later") from None
        del raw
        return await batch_from_slices_on_loop(slices)

    def _worker(self) -> Any:
        """The worker process's executor; None where processes cannot be started (then bodies parse in a thread)."""
        if self._executor is None and not self._no_worker:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            try:  # spawn: the server runs threads, and the worker needs nothing of its memory
                self._executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                     initializer=follow_parent, initargs=(os.getpid(),))
            except (ImportError, NotImplementedError, OSError) as exc:  # no semaphores (some sandboxes)
                self._no_worker = True
                warnings.warn(f"rlhf reward serve: cannot start a process to parse large bodies ({exc}); "
                              "parsing them in a thread, where they stall /health while they parse", stacklevel=2)
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class WorkerFailed(Exception):
    """The worker process died while parsing a body (the server answers 503 and starts another)."""
