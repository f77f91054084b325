"""The connections of ``rlhf reward serve``: at most ``max_connections``, idle and slow ones shed first,
and request heads counted against the ``max_buffered_mb`` budget.

Every connection aiohttp accepts goes through a `Connection` (an asyncio protocol in front of
aiohttp's own). Bytes that arrive while no request body is being received are the start of a
request head: they are taken from the same `BodyBudget` as bodies, twice over (aiohttp keeps each
header line's bytes and its decoded text), until the head is complete; a complete head is then
counted the same way by its size until its request has been answered. A head over ``max_head_kb``
answers 431. A head (or a body) that would go over the budget first sheds the oldest unfinished
heads of other connections; if that is not enough its connection answers 503 (a head's connection is
closed). A head must be complete ``head_timeout_s`` after its first byte (or ``read_timeout_s``
when shorter), and a connection with nothing to do (no bytes since it opened, or since its last
answer) is closed after ``read_timeout_s``.

A connection past ``max_connections`` sheds the connection idle the longest after an answer (kept
alive), else the one that has waited longest for its head (begun or not); connections receiving a
body or waiting for their scores are never shed. When none can be shed the new connection answers
503 and is closed. The sheddable connections wait in three queues ordered by age (fresh: nothing
sent; heading: a head begun; idle: answered, kept alive), so choosing one costs O(1) at each accept
(under 1,100 slowloris connections that is over a thousand times a second) and the timeout sweep
stops at the first connection still in time.

What is not counted: per connection at most one read from the socket (256 KiB) past the end of a
body or head, aiohttp's read buffer of a body not yet read (flow-controlled at 64-128 KiB), and
Python's fixed cost of a connection (about 10 KiB). So the server's memory stays within a small
multiple of the budget plus a fixed allowance per connection (`benchmarks/reward_server_attacks.py`).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf.rewards.limits import ServerLimits
    from rlhf.rewards.uploads import BodyBudget

SWEEP_S = 0.25  # how often timeouts are checked
FRESH_S = 1.0  # a connection this new that has sent nothing is shed last
HEAD_COST = 2  # bytes of memory per byte of head: aiohttp keeps each header's bytes and its decoded text


def head_size(message: Any) -> int:
    """Bytes of a parsed request head: its request line and header lines as sent (0 for a parse error)."""
    raw = getattr(message, "raw_headers", None)
    if raw is None:
        return 0
    line = len(getattr(message, "method", "")) + len(getattr(message, "path", "")) + 12
    return line + sum(len(name) + len(value) + 4 for name, value in raw) + 2


def refusal(message: str, status: int = 503) -> bytes:
    """A whole answer that closes the connection, for a connection refused before its request was parsed."""
    body = json.dumps({"error": message}).encode()
    reason = {431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}[status]
    retry = b"Retry-After: 1\r\n" if status == 503 else b""
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n%sConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (status, reason, retry, len(body), body))


class Connection(asyncio.Protocol):
    """One client connection, in front of aiohttp's protocol ``inner``; counts what its heads hold."""

    def __init__(self, pool: ConnectionPool, inner: Any):
        self.pool, self.inner = pool, inner
        self.transport: Any = None
        self.opened = pool.now()
        self.idle_since: float | None = None  # when it last answered a request and had nothing more to do
        self.head_started: float | None = None  # first byte of the unfinished head
        self.head_bytes = 0  # bytes of the unfinished head, taken from the budget
        self.heads: deque[int] = deque()  # sizes of the parsed heads, in order, taken until answered
        self.active = 0  # requests being handled
        self.payload: Any = None  # the body being received, if any
        self.closed = False

    # --- asyncio's protocol -------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.inner.connection_made(transport)
        self.pool.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        messages = getattr(self.inner, "_messages", None)  # aiohttp's parsed requests (a deque, since 3.0)
        if messages is None:
            self.inner.data_received(data)  # an aiohttp that hides them: heads go uncounted
            return
        receiving_body = self.payload is not None and not self.payload.is_eof()
        before = len(messages)
        self.inner.data_received(data)
        if len(messages) <= before:
            if not receiving_body:
                self.payload = None
                self.take_head(len(data))
            return  # else body bytes, counted as the request reads them (`rlhf.rewards.uploads`)
        parsed = list(islice(messages, before, None))
        self.pool.budget.give_back(self.head_bytes)  # the unfinished head is now parsed messages
        self.head_bytes, self.head_started = 0, None
        self.pool.moved(self, None)  # a request to answer: not sheddable until it is answered
        for message, _ in parsed:
            size = head_size(message) * HEAD_COST
            if size:  # a parse error has no head (aiohttp answers 400 and closes the connection)
                self.pool.budget.held += size  # already in memory: counted even if over the budget
                self.heads.append(size)
        payload = parsed[-1][1]
        self.payload = payload if getattr(payload, "total_bytes", None) is not None and not payload.is_eof() else None

    def eof_received(self) -> Any:
        return self.inner.eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.pool.remove(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # --- accounting ---------------------------------------------------------------------------

    def take_head(self, n: int) -> None:
        """Count ``n`` more bytes of an unfinished head; over a limit, answer and close the connection."""
        if self.head_started is None:
            self.head_started = self.pool.now()
            self.pool.moved(self, "heading")
        limits = self.pool.limits
        if self.head_bytes + n * HEAD_COST > limits.max_head_bytes * HEAD_COST:
            self.refuse(f"request head over {limits.max_head_kb:g} KiB (--max-head-kb)", status=431)
        elif not self.pool.take_for_head(self, n * HEAD_COST):
            self.refuse(f"server busy: request heads and bodies held fill --max-buffered-mb "
                        f"{limits.max_buffered_mb:g}; retry later")
        else:
            self.head_bytes += n * HEAD_COST

    def request_started(self) -> None:
        self.active += 1
        if self.head_started is None:
            self.pool.moved(self, None)

    def request_finished(self) -> None:
        """The oldest parsed head was answered (HTTP/1.1 answers a connection's requests in order)."""
        self.active -= 1
        if self.heads:
            self.pool.budget.give_back(self.heads.popleft())
        self.idle_since = self.pool.now()
        if self.sheddable:  # idle (kept alive), or already sending its next head
            self.pool.moved(self, "heading" if self.head_started is not None else "idle")

    def release(self) -> None:
        self.pool.budget.give_back(self.head_bytes + sum(self.heads))
        self.head_bytes = 0
        self.heads.clear()

    @property
    def sheddable(self) -> bool:
        """Nothing parsed and being handled: idle, or still sending its head."""
        return not self.closed and self.active == 0 and not self.heads

    @property
    def waiting_since(self) -> float:
        """Since when it has been waiting for a head to finish (or to start, on a new connection)."""
        return self.head_started if self.head_started is not None else self.opened

    def refuse(self, message: str, status: int = 503) -> None:
        self.closed = True
        self.pool.moved(self, None)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(refusal(message, status))
            self.transport.close()
        self.inner.connection_lost(None)  # drop what aiohttp parsed (see `shed`); the answer still goes out

    def shed(self) -> None:
        self.closed = True
        self.pool.moved(self, None)
        if self.transport is not None:
            if self.idle_since is not None and self.head_started is None:
                self.transport.close()  # idle: what it was answered still goes out
            else:
                self.transport.abort()  # nothing asked yet, nothing will be answered: no lingering
                # and aiohttp drops its parser, with the unfinished head, now rather than on the loop's next turn
                # (it does the same again, as a no-op, when the loop reports the closed socket)
                self.inner.connection_lost(None)


class ConnectionPool:
    """The open connections of one server, their cap and their timeouts (event-loop thread only)."""

    def __init__(self, limits: ServerLimits, budget: BodyBudget, max_connections: int | None = None):
        self.limits, self.budget = limits, budget
        self.max_connections = max_connections or limits.max_connections
        self.connections: dict[int, Connection] = {}  # by id, in the order they opened
        self.by_transport: dict[int, Connection] = {}
        # the sheddable connections by state, each dict in the order its members entered it (so the oldest is
        # first and choosing whom to shed costs O(1), not a scan of every connection at each accept):
        self.queues: dict[str, dict[int, Connection]] = {"fresh": {}, "heading": {}, "idle": {}}
        self.queue_of: dict[int, str] = {}  # fresh: opened, nothing sent; heading: head begun; idle: answered
        self.shed_count = {"idle": 0, "slow head": 0, "refused": 0, "head timeout": 0, "idle timeout": 0}
        self._keep: Connection | None = None  # whose head is being counted
        budget.reclaim = self.reclaim
        self._loop = asyncio.get_running_loop()
        self._sweeper = self._loop.create_task(self._sweep())

    def now(self) -> float:
        return self._loop.time()

    def wrap(self, factory: Any) -> Any:
        """A protocol factory for the event loop: aiohttp's protocols, each behind a `Connection`."""
        return lambda: Connection(self, factory())

    def add(self, connection: Connection) -> None:
        if len(self.connections) >= self.max_connections and not self._shed_one(connection):
            self.shed_count["refused"] += 1
            connection.refuse(f"server busy: {len(self.connections)} connections open (--max-connections "
                              f"{self.max_connections}), none idle; retry later")
        self.connections[id(connection)] = connection
        self.by_transport[id(connection.transport)] = connection
        if not connection.closed:
            self.moved(connection, "fresh")

    def remove(self, connection: Connection) -> None:
        connection.release()
        self.connections.pop(id(connection), None)
        self.by_transport.pop(id(connection.transport), None)
        self.moved(connection, None)

    def moved(self, connection: Connection, queue: str | None) -> None:
        """``connection`` enters ``queue`` at its end (None: leaves them: it has a request to answer, or is gone)."""
        key = id(connection)
        old = self.queue_of.pop(key, None)
        if old is not None:
            del self.queues[old][key]
        if queue is not None:
            self.queues[queue][key] = connection
            self.queue_of[key] = queue

    def _oldest(self, queue: str, keep: Connection) -> Connection | None:
        """The first sheddable connection of ``queue`` (closed ones met on the way leave it)."""
        members = self.queues[queue]
        for key, connection in list(islice(members.items(), 4)):
            if connection.closed:
                self.moved(connection, None)
            elif connection is not keep and connection.sheddable:
                return connection
        return next((c for c in members.values() if c is not keep and c.sheddable), None)

    def of(self, transport: Any) -> Connection | None:
        return self.by_transport.get(id(transport))

    def _shed_one(self, keep: Connection) -> bool:
        """Close the connection that has waited longest with nothing to do (kept alive after an answer), else
        the one that has waited longest for its head (sent in part, or not begun on a connection older than
        ``FRESH_S``), else the oldest new one."""
        idle = self._oldest("idle", keep)
        if idle is not None:
            idle.shed()
            self.shed_count["idle"] += 1
            return True
        now = self.now()

        def order(c: Connection) -> tuple[bool, float]:  # a new connection that has not spoken yet comes last:
            just_opened = c.head_started is None and now - c.opened < FRESH_S  # its request may be on its way
            return just_opened, c.waiting_since

        candidates = [c for c in (self._oldest("heading", keep), self._oldest("fresh", keep)) if c is not None]
        if candidates:
            min(candidates, key=order).shed()
            self.shed_count["slow head"] += 1
            return True
        return False

    def take_for_head(self, connection: Connection, n: int) -> bool:
        """Take ``n`` bytes for ``connection``'s head (the budget sheds older unfinished heads to make room)."""
        self._keep = connection
        try:
            return self.budget.take(n)
        finally:
            self._keep = None

    def reclaim(self, n: int) -> None:
        """Close connections still sending their heads, oldest first, until ``n`` bytes are free (or none is left)."""
        keep = self._keep
        started = keep.head_started if keep is not None else None
        victims = sorted((c for c in self.queues["heading"].values() if c is not keep and c.sheddable and c.head_bytes
                          and (started is None or c.head_started <= started)), key=lambda c: c.head_started)
        freed = 0
        for victim in victims:
            if freed >= n:
                break
            freed += victim.head_bytes
            victim.shed()
            victim.release()  # now: the loop reports the closed socket later
            self.shed_count["slow head"] += 1

    async def _sweep(self) -> None:
        limits = self.limits
        head_timeout, idle_timeout = min(limits.head_timeout_s, limits.read_timeout_s), limits.read_timeout_s
        while True:
            await asyncio.sleep(SWEEP_S)
            now = self.now()
            for queue, timeout, reason in (("heading", head_timeout, "head timeout"), ("fresh", idle_timeout,
                                           "idle timeout"), ("idle", idle_timeout, "idle timeout")):
                for connection in list(self.queues[queue].values()):  # oldest first: stop at the first in time
                    since = connection.waiting_since if queue != "idle" else connection.idle_since
                    if since is None or now - since <= timeout:
                        break
                    if connection.closed:
                        self.moved(connection, None)
                    elif connection.sheddable:
                        self.shed_count[reason] += 1
                        connection.shed()

    def close(self) -> None:
        self._sweeper.cancel()
        self.budget.reclaim = None
