"""Serve any reward source over HTTP with OpenRLHF's protocol (``rlhf reward serve``), on aiohttp.

Routes: ``GET /health`` -> ``{"status": "ok", "reward": NAME}``; ``POST`` on any other path (OpenRLHF
clients post to ``/get_reward``) with ``{"query": [...], "prompts"?: [...], "labels"?: [...]}`` ->
``{"rewards": [...], "scores": [...], "extra_logs": {...}}``. The completion of each sample is its
query minus its prompt when the query starts with it, else the whole query.

Limits (`ServerLimits`, each a ``rlhf reward serve`` option): a body over ``max_body_mb`` answers
413 (checked against Content-Length before reading), more than ``max_samples`` samples or JSON
nested deeper than ``max_depth`` 400, a body not fully received within ``read_timeout_s`` 408,
and a connection that sends no complete request within ``read_timeout_s`` is closed. At most
``max_concurrency`` scoring requests are in flight (reading included); one more answers 503 with
``Retry-After`` at once, so stalled or huge uploads never block ``/health`` or other clients. JSON
is parsed off the event loop.

A sample the source fails on answers HTTP 500 with ``{"error": ...}`` naming the function and the
sample, so the client's own failure policy decides (with ``on_error`` zero or skip the server
scores such samples 0 or ``null`` instead). With a token, every POST needs
``Authorization: Bearer <token>`` (401 otherwise).

Threads: the HTTP loop runs in a background thread; sync functions and reward models run in the
thread that called `RewardServer.run` (the main thread under ``rlhf reward serve``), one batch at a
time, so functions that need the main thread (signal-based timeouts) work and ``/health`` stays
responsive while a batch is scored.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import queue
import socket
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from rlhf.rewards.failures import RewardError, apply_policy
from rlhf.rewards.source import RewardBatch, RewardSource, SourceOutput



@dataclass(frozen=True)
class ServerLimits:
    """What one request may cost the server; the defaults fit a large rollout batch."""

    max_body_mb: float = 32.0  # request body
    max_samples: int = 16384  # entries of "query"
    max_depth: int = 64  # JSON nesting (labels may be structured)
    read_timeout_s: float = 30.0  # to receive a whole request (headers and body)
    max_concurrency: int = 16  # scoring requests in flight; one more answers 503

    def __post_init__(self) -> None:
        for name in ("max_body_mb", "max_samples", "max_depth", "read_timeout_s", "max_concurrency"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)


class BadRequest(Exception):
    pass


def parse_body(raw: bytes, limits: ServerLimits) -> Any:
    """JSON with a bounded nesting depth (a deep document is a 400, never a RecursionError)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"JSON nested deeper than {limits.max_depth} levels") from None
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
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


class RewardServer:
    """An aiohttp server around one reward source. ``start()`` binds; ``run()`` serves until ``stop()``."""

    def __init__(self, source: RewardSource, *, host: str = "127.0.0.1", port: int = 5000,
                 token: str | None = None, limits: ServerLimits | None = None):
        self.source, self.host, self.port, self.token = source, host, port, token
        self.limits = limits or ServerLimits()
        self._in_flight = 0
        self._served: weakref.WeakSet[Any] = weakref.WeakSet()  # transports that sent a whole request head
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
        async def mark_served(request: Any, handler: Any) -> Any:
            if request.transport is not None:
                self._served.add(request.transport)
            return await handler(request)

        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[mark_served])
        app.router.add_get("/health", self._health)
        app.router.add_post("/{tail:.*}", self._score)
        return app

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok", "reward": self.source.name})

    async def _score(self, request: Any) -> Any:
        from aiohttp import web

        if self.token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        limits = self.limits
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            return web.json_response({"error": f"request body of {request.content_length} bytes is over the "
                                      f"{limits.max_body_mb:g} MiB limit (--max-body-mb)"}, status=413)
        if self._in_flight >= limits.max_concurrency:
            return web.json_response({"error": f"server busy: {self._in_flight} requests in flight "
                                      f"(--max-concurrency {limits.max_concurrency}); retry later"},
                                     status=503, headers={"Retry-After": "1"})
        self._in_flight += 1
        try:
            return await self._score_admitted(request)
        finally:
            self._in_flight -= 1

    async def _score_admitted(self, request: Any) -> Any:
        from aiohttp import web

        limits = self.limits
        try:
            raw = await asyncio.wait_for(request.read(), timeout=limits.read_timeout_s)
        except asyncio.TimeoutError:
            return web.json_response({"error": f"request body not received within {limits.read_timeout_s:g} s "
                                      "(--read-timeout-s)"}, status=408, headers={"Connection": "close"})
        except web.HTTPRequestEntityTooLarge:
            return web.json_response({"error": f"request body over the {limits.max_body_mb:g} MiB limit "
                                      "(--max-body-mb)"}, status=413, headers={"Connection": "close"})
        try:
            data = await asyncio.get_running_loop().run_in_executor(None, parse_body, raw, limits)
            batch = batch_from_request(data)
        except (ValueError, BadRequest) as exc:
            return web.json_response({"error": f"bad request: {exc}"}, status=400)
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
            return await self.source.ascore_batch(batch)
        future: concurrent.futures.Future[SourceOutput] = concurrent.futures.Future()
        self._jobs.put((batch, future))
        return await asyncio.wrap_future(future)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> str:
        """Bind the port in a background thread (``port=0`` picks a free one) and return the URL."""
        from aiohttp import web

        ready: concurrent.futures.Future[int] = concurrent.futures.Future()

        async def serve() -> None:
            timeout = self.limits.read_timeout_s
            runner = web.AppRunner(self.make_app(), access_log=None, keepalive_timeout=timeout,
                                   lingering_time=1.0)  # after a 408/413, do not wait 10 s for the rest
            await runner.setup()
            self._close_stalled_connections(runner, timeout)
            try:
                family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, self.port))
                await web.SockSite(runner, sock).start()
                ready.set_result(sock.getsockname()[1])
                while not self._stopped.is_set():
                    await asyncio.sleep(0.1)
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                raise
            finally:
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

    def _close_stalled_connections(self, runner: Any, timeout: float) -> None:
        """Close a connection that has not sent a whole request head ``timeout`` s after connecting
        (slow or stalled uploads; aiohttp itself waits for headers forever)."""
        server = runner.server
        loop = asyncio.get_running_loop()

        def expire(protocol: Any) -> None:
            transport = protocol.transport
            if transport is not None and not transport.is_closing() and transport not in self._served:
                transport.close()

        def factory() -> Any:
            protocol = server()
            loop.call_later(timeout, expire, protocol)
            return protocol

        runner._server = _Factory(server, factory)  # what the sites hand to loop.create_server

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
            try:
                future.set_result(self.source.score_batch(batch))
            except BaseException as exc:  # noqa: BLE001 - the request answers 500
                future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise

    def stop(self) -> None:
        self._stopped.set()
        self._jobs.put(None)


class _Factory:
    """The aiohttp server, with its protocol factory replaced (the event loop calls the object)."""

    def __init__(self, server: Any, factory: Any):
        self._server, self._factory = server, factory

    def __call__(self) -> Any:
        return self._factory()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)
