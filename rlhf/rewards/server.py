"""Serve any reward source over HTTP with OpenRLHF's protocol (``rlhf reward serve``), on aiohttp.

Routes: ``GET /health`` -> ``{"status": "ok", "reward": NAME}``; ``POST`` on any other path (OpenRLHF
clients post to ``/get_reward``) with ``{"query": [...], "prompts"?: [...], "labels"?: [...]}`` ->
``{"rewards": [...], "scores": [...], "extra_logs": {...}}``. The completion of each sample is its
query minus its prompt when the query starts with it, else the whole query.

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
from typing import Any

from rlhf.rewards.failures import RewardError, apply_policy
from rlhf.rewards.source import RewardBatch, RewardSource, SourceOutput

MAX_BODY_BYTES = 256 * 1024 * 1024


class BadRequest(Exception):
    pass


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
                 token: str | None = None):
        self.source, self.host, self.port, self.token = source, host, port, token
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

        app = web.Application(client_max_size=MAX_BODY_BYTES)
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
        try:
            batch = batch_from_request(json.loads(await request.read()))
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
            runner = web.AppRunner(self.make_app(), access_log=None)
            await runner.setup()
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
