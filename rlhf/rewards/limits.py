"""`ServerLimits`: what one request to ``rlhf reward serve``, and all of them together, may cost the server.

Each field is a ``rlhf reward serve`` option; the server, its connections
(`rlhf.rewards.connections`), the body reader (`rlhf.rewards.uploads`) and the JSON parser
(`rlhf.rewards.request_json`) enforce them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """What one request, and all of them together, may cost the server; the defaults fit a large rollout batch."""

    max_body_mb: float = 32.0  # request body
    max_samples: int = 16384  # entries of "query"
    max_depth: int = 64  # JSON nesting (labels may be structured)
    read_timeout_s: float = 30.0  # to receive a request body; a connection with nothing to do is closed after it
    head_timeout_s: float = 10.0  # to receive a whole request head, from its first byte
    max_head_kb: float = 64.0  # request line and headers; larger: 431
    max_connections: int = 512  # open connections; one more sheds an idle or slow one, else answers 503
    max_concurrency: int = 16  # requests being scored; one more answers 503
    max_uploads: int = 64  # request bodies being received at once; one more answers 503
    min_upload_kib_s: float = 16.0  # slowest average body rate after the first second; slower: 408
    max_buffered_mb: float | None = None  # bytes of heads and bodies held at once (default 4 x max_body_mb); over: 503
    sync_threads: int = 16  # threads for --sync-in-thread calls, hung ones included
    stalled_after_s: float = 180.0  # /health answers 503 "stalled" once a batch has run this long

    json_values_per_sample = 64  # a body may hold max_samples times this many JSON values

    def __post_init__(self) -> None:
        for name in ("max_body_mb", "max_samples", "max_depth", "read_timeout_s", "max_concurrency", "max_uploads",
                     "min_upload_kib_s", "head_timeout_s", "max_connections",
                     "max_head_kb", "sync_threads", "stalled_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_buffered_mb is None:
            object.__setattr__(self, "max_buffered_mb", 4 * self.max_body_mb)
        elif not self.max_buffered_mb >= self.max_body_mb:
            raise ValueError(f"max_buffered_mb ({self.max_buffered_mb:g}) must be at least max_body_mb "
                             f"({self.max_body_mb:g}), or no body of the largest size could be received")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def max_head_bytes(self) -> int:
        return int(self.max_head_kb * 1024)

    @property
    def max_buffered_bytes(self) -> int:
        return int(self.max_buffered_mb * 1024 * 1024)

    @property
    def max_json_values(self) -> int:
        return self.max_samples * self.json_values_per_sample
