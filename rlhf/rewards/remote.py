"""Remote reward servers over HTTP, speaking OpenRLHF's protocol so existing servers work unchanged.

Request: ``POST <url>`` with JSON ``{"query": [...], "prompts": [...], "labels": [...]}`` (query =
prompt text + completion). Response: ``{"rewards": [...], "scores"?: [...], "extra_logs"?: {...}}``;
a reward may be a number, ``null`` (no score) or a one-element list.

Deviations from OpenRLHF (``utils/agent.py``, which sends one sample per request, reads only the
first server's answer and retries 5 times 1 s apart): samples go in batches of ``http_batch_size``;
batches are spread round-robin over several URLs and a retry moves to the next URL; retries back off
exponentially (with jitter) up to ``backoff_max_s``; every request has a timeout; a response is
checked (JSON, length, finite numbers) and a bad one counts as a failure, never as a score.
Retried: connection errors, timeouts, HTTP 5xx, 408, 429 and malformed bodies. Not retried: other
4xx (a wrong URL or token will not fix itself) and non-finite values (per-sample failures).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random
from typing import Any
from urllib.parse import urlsplit

from rlhf.rewards.failures import RewardConfigError, excerpt
from rlhf.rewards.options import DEFAULT_TOKEN_ENV, RewardOptions
from rlhf.rewards.returns import BadReturn, batched_return, to_number
from rlhf.rewards.source import RewardBatch, RewardSource, SourceOutput
from rlhf.rewards.threads import CallLimit


def read_token(token_env: str | None, flag: str = "--reward-token-env") -> str | None:
    """The bearer token: from ``token_env`` (which must then be set), else from RLHF_REWARD_TOKEN if set."""
    if token_env:
        token = os.environ.get(token_env, "")
        if not token:
            raise RewardConfigError(f"environment variable {token_env} (named by {flag}) is not set or is empty")
        return token
    return os.environ.get(DEFAULT_TOKEN_ENV) or None


def parse_urls(spec: str) -> list[str]:
    """Split ``http://a/x,http://b/x`` into URLs, checking each one."""
    urls = [u.strip() for u in spec.split(",") if u.strip()]
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RewardConfigError(f"{url!r} is not an http(s) URL (several URLs are separated by commas)")
    if not urls:
        raise RewardConfigError(f"no URL in reward spec {spec!r}")
    return urls


def parse_response(body: bytes, n: int) -> tuple[list[Any], list[float | None] | None, dict[str, list[float]]]:
    """Raw rewards, scores and extra logs from a response body; `BadReturn` when it is unusable."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        text = excerpt(body.decode(errors="replace"))
        raise BadReturn("bad value", f"response is not JSON ({exc}): {text}") from None
    if not isinstance(data, dict) or "rewards" not in data:
        raise BadReturn("bad value", f"response has no 'rewards': {excerpt(json.dumps(data))}")
    if n == 1:  # OpenRLHF servers may answer a single sample with scalars
        data = {k: ([v] if k in ("rewards", "scores") and not isinstance(v, list) and v is not None else v)
                for k, v in data.items()}
    return batched_return({"rewards": data["rewards"], "scores": data.get("scores"),
                           "extra_logs": data.get("extra_logs")}, n)


class HttpSource(RewardSource):
    """A reward server (or several, load-balanced) speaking OpenRLHF's protocol."""

    kind = "http"

    def __init__(self, urls: list[str], name: str, options: RewardOptions | None = None):
        super().__init__(name, ", ".join(urls), options)
        self.limit = CallLimit(self.options.concurrency)  # requests in flight, over every batch being scored
        self.urls = list(urls)
        self.token = read_token(self.options.token_env)
        self._turn = itertools.count()  # round-robin position over the URLs

    async def _ascore(self, batch: RewardBatch) -> SourceOutput:
        import aiohttp

        n, size = len(batch), self.options.http_batch_size
        chunks = [list(range(start, min(start + size, n))) for start in range(0, n, size)]
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        limit = self.limit
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            results = await asyncio.gather(*(self._post(session, limit, batch, chunk) for chunk in chunks))
        output = SourceOutput(values=[None] * n)
        for chunk, result in zip(chunks, results):
            self._merge(output, batch, chunk, result)
        return output

    async def _post(self, session: Any, limit: CallLimit, batch: RewardBatch, chunk: list[int]) -> Any:
        """One batch of samples, with retries; returns the parsed response or a (reason, message) pair."""
        import aiohttp

        payload = json.dumps({"query": [batch.prompt_texts[i] + batch.completions[i] for i in chunk],
                              "prompts": [batch.prompt_texts[i] for i in chunk],
                              "labels": [batch.labels[i] for i in chunk]}, default=str)
        first = next(self._turn)
        reason, last = "http", ""
        attempts = self.options.retries + 1
        for attempt in range(attempts):
            url = self.urls[(first + attempt) % len(self.urls)]
            retry = True
            try:
                async with limit, session.post(url, data=payload) as response:
                    body = await response.read()
                    status = response.status
            except asyncio.TimeoutError:
                reason = "timeout"
                last = f"no response from {url} within {self.options.timeout_s:g} s (--reward-timeout-s)"
            except (aiohttp.ClientError, OSError) as exc:
                reason, last = "http", f"{url}: {type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    try:
                        return parse_response(body, len(chunk))
                    except BadReturn as exc:
                        reason, last = "http", f"{url} answered HTTP 200 with a bad body: {exc.message}"
                else:
                    text = excerpt(body.decode(errors="replace"), 300)
                    reason, last = "http", f"{url} answered HTTP {status}: {text}"
                    retry = status >= 500 or status in (408, 429)
            if not retry or attempt == attempts - 1:
                return reason, f"POST failed after {attempt + 1} attempt(s); last error: {last}"
            delay = min(self.options.backoff_s * 2**attempt, self.options.backoff_max_s)
            await asyncio.sleep(delay * (0.5 + random.random() / 2))
        raise AssertionError("unreachable")

    def _merge(self, output: SourceOutput, batch: RewardBatch, chunk: list[int], result: Any) -> None:
        if isinstance(result[0], str):  # (reason, message): every sample of the request failed
            reason, message = result
            for i in chunk:
                output.failures[i] = self.failure(batch, i, reason, message)
            return
        raw, scores, extra_logs = result
        for i, item in zip(chunk, raw):
            try:
                value = to_number(item)
            except ValueError as exc:
                output.failures[i] = self.failure(batch, i, "bad value", f"server returned {exc}")
                continue
            if value is not None and not math.isfinite(value):
                output.failures[i] = self.failure(batch, i, "not finite", f"server returned {value}")
                continue
            output.values[i] = value
        if scores is not None:
            output.scores = output.scores or [None] * len(batch)
            for i, score in zip(chunk, scores):
                output.scores[i] = score
        for key, values in extra_logs.items():
            output.extra_logs.setdefault(key, []).extend(values)
