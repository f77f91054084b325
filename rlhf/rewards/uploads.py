"""Receiving request bodies under limits: a deadline, a minimum rate and a memory budget.

A body must arrive within ``read_timeout_s`` and, after its first second, at an average of at least
``min_upload_kib_s`` (a client trickling a byte a second is cut off in about a second, whatever
Content-Length it announced). The bytes of all bodies held at once (being received, parsed or
scored) and of request heads (`rlhf.rewards.connections`) stay within ``max_buffered_mb``: a body
that would go over it first closes connections that are still sending their heads, oldest first,
and if that is not enough answers 503 at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf.rewards.limits import ServerLimits

GRACE_S = 1.0  # seconds before the minimum rate applies (a small body arrives within them)


class UploadRefused(Exception):
    """A body not received: ``status`` is the HTTP answer, the message names the limit."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class BodyBudget:
    """Bytes of request bodies held in memory at once, over every request (event-loop thread only)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.reclaim: Callable[[int], None] | None = None  # frees room by closing slow connections (their heads)

    def take(self, n: int) -> bool:
        if self.held + n > self.limit and self.reclaim is not None:
            self.reclaim(self.held + n - self.limit)
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give_back(self, n: int) -> None:
        self.held -= n


class HeldBody:
    """One request's body, counted against a `BodyBudget` until `release`."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes, limits: ServerLimits) -> None:
        if self.size + len(chunk) > limits.max_body_bytes:
            raise UploadRefused(413, f"request body over the {limits.max_body_mb:g} MiB limit (--max-body-mb)")
        if not self.budget.take(len(chunk)):
            raise UploadRefused(503, f"server busy: {self.budget.held / 2**20:.1f} MiB of request bodies held "
                                f"(--max-buffered-mb {limits.max_buffered_mb:g}); retry later")
        self.chunks.append(chunk)
        self.size += len(chunk)

    def join(self) -> bytes:
        raw = b"".join(self.chunks)
        self.chunks = [raw]
        return raw

    def drop_bytes(self) -> None:
        """Free the bytes once parsed; they stay counted, as the parsed body takes their place."""
        self.chunks = []

    def release(self) -> None:
        self.budget.give_back(self.size)
        self.chunks, self.size = [], 0


async def receive_body(request: Any, held: HeldBody, limits: ServerLimits) -> bytes:
    """Read the whole body of an aiohttp request into ``held``; `UploadRefused` when a limit is hit."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    rate = limits.min_upload_kib_s * 1024
    while True:
        total_deadline = started + limits.read_timeout_s
        rate_deadline = started + GRACE_S + held.size / rate  # when what arrived so far becomes too little
        deadline = min(total_deadline, rate_deadline)
        try:
            chunk = await asyncio.wait_for(request.content.readany(), timeout=max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            if deadline == total_deadline:
                raise UploadRefused(408, f"request body not received within {limits.read_timeout_s:g} s "
                                    "(--read-timeout-s)") from None
            elapsed = loop.time() - started
            raise UploadRefused(408, f"request body arriving slower than {limits.min_upload_kib_s:g} KiB/s "
                                f"({held.size} bytes after {elapsed:.1f} s; --min-upload-kib-s)") from None
        except (ConnectionError, OSError) as exc:
            raise UploadRefused(400, f"request body not received: {exc}") from None
        except Exception as exc:  # aiohttp's payload errors (a broken chunked encoding, a reset)
            if type(exc).__module__.startswith("aiohttp"):
                raise UploadRefused(400, f"request body not received: {exc}") from None
            raise
        if not chunk:
            return held.join()
        held.add(chunk, limits)
