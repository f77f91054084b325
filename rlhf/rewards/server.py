"""Serve any reward source over HTTP with OpenRLHF's protocol (``rlhf reward serve``), on aiohttp.

Routes: ``GET /health`` -> ``{"status": "ok", "reward": NAME}``; ``POST`` on any other path (OpenRLHF
clients post to ``/get_reward``) with ``{"query": [...], "prompts"?: [...], "labels"?: [...]}`` ->
``{"rewards": [...], "scores": [...], "extra_logs": {...}}``. The completion of each sample is its
query minus its prompt when the query starts with it, else the whole query.

Limits (`ServerLimits`, each a ``rlhf reward serve`` option). Connections
(`rlhf.rewards.connections`): at most ``max_connections`` are open (lowered to fit the open-file
limit); one more sheds the oldest idle connection, else the oldest one still sending its head, else
answers 503. A request head must be complete ``head_timeout_s`` after its first byte; a connection
with nothing to do is closed after ``read_timeout_s``. Receiving a body (`rlhf.rewards.uploads`)
takes no scoring slot: at most ``max_uploads`` bodies are received at once (one more: 503 with
``Retry-After``); each must arrive within ``read_timeout_s`` and, after its first second, at
``min_upload_kib_s`` or faster (408 otherwise, so tricklers are cut off in seconds). A body over
``max_body_mb`` answers 413 (from Content-Length before reading, or as it grows); the request heads
and bodies held at once (being received, parsed or scored) stay within ``max_buffered_mb`` (default
4 x ``max_body_mb``; a body that would go over it: 503; a head: older unfinished heads are shed,
else 503). Bodies are parsed one at a time, after counting their JSON values
(`rlhf.rewards.request_json`: at most 64 per sample of ``max_samples``, keys the protocol ignores
included), so memory per request stays a small multiple of its size; more than ``max_samples``
samples or JSON nested deeper than ``max_depth`` answer 400. Bodies over 256 KiB are parsed in a
worker process, since ``json`` holds the GIL while it parses and would stall the event loop. Then
at most ``max_concurrency`` requests are scored at once; one more answers 503 at once. So stalled,
slow or huge uploads and heads never block ``/health`` or other clients.

``/health`` says ``"busy"`` (with ``batch_running_s``) while a batch is scored, and answers 503
``"stalled"`` once a batch has run past ``stalled_after_s`` or every ``--sync-in-thread`` thread is
stuck in a call that outlived its timeout (``hung_threads``). Threaded calls take one of
``sync_threads`` threads; once all are stuck, scoring requests answer 503 instead of starting more.

A sample the source fails on answers HTTP 500 with ``{"error": ...}`` naming the function and the
sample, so the client's own failure policy decides (with ``on_error`` zero or skip the server
scores such samples 0 or ``null`` instead). With a token, every POST needs
``Authorization: Bearer <token>`` (401 otherwise, whatever bytes the header holds; compared in
constant time).

Latency (`tune_interpreter`, for ``rlhf reward serve``, which owns its process): a 1 ms GIL switch
interval, the objects of the started server frozen out of the garbage collector, and full collections
run by the server between large batches, not in the middle of them; large bodies parse in a worker
process of lower priority and come back in slices the event loop unpickles one per turn.

Threads: the HTTP loop runs in a background thread; sync functions and reward models run in the
thread that called `RewardServer.run` (the main thread under ``rlhf reward serve``), one batch at a
time, so functions that need the main thread (signal-based timeouts) work and ``/health`` stays
responsive while a batch is scored.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import hmac
import queue
import socket
import sys
import threading
import time
from typing import Any

from rlhf.rewards.connections import ConnectionPool
from rlhf.rewards.failures import RewardError, apply_policy
from rlhf.rewards.limits import ServerLimits
from rlhf.rewards.request_json import (IN_PROCESS_MAX_BYTES, BadRequest, BodyParser, WorkerFailed,
                                       batch_from_request, parse_body)
from rlhf.rewards.source import RewardBatch, RewardSource, SourceOutput
from rlhf.rewards.threads import ThreadSlots
from rlhf.rewards.uploads import BodyBudget, HeldBody, UploadRefused, receive_body

__all__ = ["BadRequest", "RewardServer", "ServerLimits", "batch_from_request", "parse_body"]


class RewardServer:
    """An aiohttp server around one reward source. ``start()`` binds; ``run()`` serves until ``stop()``."""

    def __init__(self, source: RewardSource, *, host: str = "127.0.0.1", port: int = 5000,
                 token: str | None = None, limits: ServerLimits | None = None, own_process: bool = False):
        self.source, self.host, self.port, self.token = source, host, port, token
        self.limits = limits or ServerLimits()
        self.own_process = own_process  # the process serves and does nothing else: `tune_interpreter` on start
        self._collector: Collector | None = None
        self._large_batches = 0  # parsed batches of large bodies in memory (being scored)
        self._in_flight = 0  # requests being scored
        self._uploads = 0  # request bodies being received
        self._bodies = BodyBudget(self.limits.max_buffered_bytes)
        self._parsing: dict[bool, asyncio.Lock] = {}  # one large and one small body parsed at a time
        self._parser = BodyParser(self.limits)
        self._connections: ConnectionPool | None = None
        self.max_connections = self.limits.max_connections  # lower once started if the open-file limit is
        self._threads = ThreadSlots(self.limits.sync_threads)
        self._batches_started: dict[int, float] = {}  # running batches: their monotonic start
        self._jobs: queue.Queue[tuple[RewardBatch, concurrent.futures.Future] | None] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._reported: set[str] = set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def make_app(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def track(request: Any, handler: Any) -> Any:
            pool = self._connections
            connection = pool.of(request.transport) if pool is not None else None
            if connection is None:
                return await handler(request)
            connection.request_started()
            try:
                response = await handler(request)
                if isinstance(response, web.Response):  # sent before the connection counts as idle again
                    await response.prepare(request)
                    await response.write_eof()
                return response
            finally:
                connection.request_finished()

        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[track])
        app.router.add_get("/health", self._health)
        app.router.add_post("/{tail:.*}", self._score)
        return app

    def health(self) -> tuple[int, dict[str, Any]]:
        """``(HTTP status, body)`` of ``GET /health``: ok when idle, busy while scoring, 503 stalled when a
        batch has run past ``stalled_after_s`` or every ``--sync-in-thread`` thread is stuck."""
        body: dict[str, Any] = {"status": "ok", "reward": self.source.name}
        started = list(self._batches_started.values())
        if started:
            running = time.monotonic() - min(started)
            body.update(status="busy", batch_running_s=round(running, 1), batches_running=len(started))
            if running > self.limits.stalled_after_s:
                body.update(status="stalled", error=f"a batch has been scoring for {running:.0f} s, more than "
                            f"{self.limits.stalled_after_s:g} s (--stalled-after-s): the reward may hang")
        if self._threads.abandoned:
            body["hung_threads"] = self._threads.abandoned
            if self._threads.exhausted:
                body.update(status="stalled", error=self._threads_exhausted_message())
        return (503 if body["status"] == "stalled" else 200), body

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        status, body = self.health()
        return web.json_response(body, status=status)

    def _threads_exhausted_message(self) -> str:
        n = self._threads.size
        return (f"all {n} reward threads (--sync-threads {n}) are stuck in calls that ran past their timeout and "
                "never returned; fix or restart the reward")

    def _authorized(self, request: Any) -> bool:
        expected = f"Bearer {self.token}".encode()
        given = next((value for name, value in request.raw_headers if name.lower() == b"authorization"), b"")
        return hmac.compare_digest(given, expected)  # bytes: any header, ASCII or not, compares in constant time

    async def _score(self, request: Any) -> Any:
        from aiohttp import web

        def refuse(status: int, message: str, **headers: str) -> Any:
            return web.json_response({"error": message}, status=status, headers=headers or None)

        if self.token is not None and not self._authorized(request):
            return refuse(401, "missing or wrong bearer token")
        limits = self.limits
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            return refuse(413, f"request body of {request.content_length} bytes is over the "
                          f"{limits.max_body_mb:g} MiB limit (--max-body-mb)")
        if self._threads.exhausted:
            return refuse(503, self._threads_exhausted_message(), **{"Retry-After": "10"})
        if self._uploads >= limits.max_uploads:
            return refuse(503, f"server busy: {self._uploads} request bodies being received (--max-uploads "
                          f"{limits.max_uploads}); retry later", **{"Retry-After": "1"})
        held = HeldBody(self._bodies)
        try:
            self._uploads += 1
            try:
                raw = await receive_body(request, held, limits)
            except UploadRefused as exc:
                retry = {"Retry-After": "1"} if exc.status == 503 else {}
                return refuse(exc.status, str(exc), Connection="close", **retry)
            finally:
                self._uploads -= 1
            try:
                big = len(raw) > IN_PROCESS_MAX_BYTES  # small bodies never wait behind a big one
                if big not in self._parsing:
                    self._parsing[big] = asyncio.Lock()
                async with self._parsing[big]:
                    batch = await self._parser.parse(raw)
                del raw
                held.drop_bytes()
            except (ValueError, BadRequest) as exc:
                return refuse(400, f"bad request: {exc}")
            except WorkerFailed as exc:
                return refuse(503, str(exc), **{"Retry-After": "1"})
            if self._in_flight >= limits.max_concurrency:
                return refuse(503, f"server busy: {self._in_flight} requests being scored (--max-concurrency "
                              f"{limits.max_concurrency}); retry later", **{"Retry-After": "1"})
            self._in_flight += 1
            self._large_batches += big
            try:
                return await self._score_batch(batch)
            finally:
                self._in_flight -= 1
                self._large_batches -= big
        finally:
            held.release()

    async def _score_batch(self, batch: RewardBatch) -> Any:
        from aiohttp import web

        try:
            output = await self._run(batch)
            values, _ = apply_policy(output.values, output.failures, self.source.options.on_error, self._reported)
        except RewardError as exc:
            return web.json_response({"error": str(exc)}, status=500)
        except Exception as exc:  # noqa: BLE001 - a bug in the source: tell the client, keep serving
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)
        body: dict[str, Any] = {"rewards": values, "scores": output.scores or values}
        if output.extra_logs:
            body["extra_logs"] = output.extra_logs
        return web.json_response(body)

    async def _run(self, batch: RewardBatch) -> SourceOutput:
        if not self.source.inline:
            self._threads.use()  # this request's --sync-in-thread calls take bounded threads
            key = id(batch)
            self._batches_started[key] = time.monotonic()
            try:
                return await self.source.ascore_batch(batch)
            finally:
                del self._batches_started[key]
        future: concurrent.futures.Future[SourceOutput] = concurrent.futures.Future()
        self._jobs.put((batch, future))
        return await asyncio.wrap_future(future)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> str:
        """Bind the port in a background thread (``port=0`` picks a free one) and return the URL."""
        from aiohttp import web

        ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.max_connections = connection_cap(self.limits.max_connections)
        if self.own_process:
            self._collector = tune_interpreter()

        async def serve() -> None:
            runner = web.AppRunner(self.make_app(), access_log=None, keepalive_timeout=self.limits.read_timeout_s,
                                   lingering_time=1.0)  # after a 408/413, do not wait 10 s for the rest
            await runner.setup()
            self._connections = ConnectionPool(self.limits, self._bodies, self.max_connections)
            runner._server = _Factory(runner.server, self._connections.wrap(runner.server))
            try:
                family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, self.port))
                await web.SockSite(runner, sock).start()
                ready.set_result(sock.getsockname()[1])
                while not self._stopped.is_set():
                    await asyncio.sleep(0.1)
                    if self._collector is not None:
                        self._collector.tick(busy=self._large_batches > 0)
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                raise
            finally:
                self._connections.close()
                self._parser.close()
                await runner.cleanup()

        def target() -> None:
            try:
                asyncio.run(serve())
            except BaseException:  # noqa: BLE001 - reported through `ready`
                pass
            finally:
                self._stopped.set()
                self._jobs.put(None)

        threading.Thread(target=target, daemon=True, name="rlhf-reward-server").start()
        self.port = ready.result(timeout=60)
        return self.url

    def run(self) -> None:
        """Score inline batches in this thread until `stop` (or Ctrl-C)."""
        while not self._stopped.is_set():
            try:
                job = self._jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            if job is None:
                break
            batch, future = job
            key = id(batch)
            self._batches_started[key] = time.monotonic()
            try:
                output = self.source.score_batch(batch)
            except BaseException as exc:  # noqa: BLE001 - the request answers 500
                self._batches_started.pop(key, None)
                future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            # off the running batches before the answer can go out: a /health right after it says ok
            self._batches_started.pop(key, None)
            future.set_result(output)

    def stop(self) -> None:
        self._stopped.set()
        self._jobs.put(None)


SWITCH_INTERVAL_S = 0.001  # how long a thread may hold the GIL while another waits (Python's default: 5 ms)


def tune_interpreter() -> Collector:
    """Tune this interpreter for the server's latency, in a process that only serves (``own_process``).

    The event loop thread shares the GIL with the thread scoring batches, so each time it wakes up it
    may wait a switch interval for the GIL: 1 ms instead of 5. The garbage collector's full passes
    hold the GIL while they visit every tracked object: with two parsed 16,384-sample batches in
    memory (a list of labels per sample) one took 100-150 ms. So the objects alive once the server
    has started are frozen (never visited again), young collections run more often and each visits
    fewer objects (threshold ``(700, 2, never)``), and full collections are run by the server itself
    (`Collector`) when no large batch is in memory. Returns that collector.
    """
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.collect()
    gc.freeze()
    gc.set_threshold(700, 2, 1 << 30)  # the oldest generation: only through `Collector.tick`
    return Collector()


class Collector:
    """Full garbage collections at moments the server chooses: at most every ``quiet_s`` seconds while no
    large batch is in memory, and at least every ``max_s`` seconds even under a sustained load of large
    batches (then a pause of tens of milliseconds per batch in memory)."""

    def __init__(self, quiet_s: float = 5.0, max_s: float = 60.0, clock: Any = time.monotonic):
        self.quiet_s, self.max_s, self.clock = quiet_s, max_s, clock
        self.last = clock()
        self.runs = 0

    def tick(self, busy: bool) -> None:
        """Called every 0.1 s by the event loop; ``busy``: a large batch is in memory."""
        since = self.clock() - self.last
        if since >= self.max_s or (since >= self.quiet_s and not busy):
            gc.collect()
            self.last = self.clock()
            self.runs += 1


def connection_cap(wanted: int, spare: int = 64) -> int:
    """``wanted`` connections, or fewer when the open-file limit (raised to its hard maximum) is lower."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted + spare:
        target = wanted + spare if hard == resource.RLIM_INFINITY else min(hard, wanted + spare)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - spare))


class _Factory:
    """The aiohttp server, with its protocol factory replaced (the event loop calls the object)."""

    def __init__(self, server: Any, factory: Any):
        self._server, self._factory = server, factory

    def __call__(self) -> Any:
        return self._factory()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)
