"""Run code on a remote SandboxFusion-style server instead of locally (for clusters).

Protocol (SandboxFusion's ``/run_code``, which the OpenRLHF fork's TIR loop also speaks): POST
``{url}/run_code`` with ``{"code", "language": "python", "run_timeout", "compile_timeout",
"memory_limit_MB", "stdin"}``. The response's ``run_result`` holds ``status`` (``Finished``,
``TimeLimitExceeded`` or ``Error``), ``return_code``, ``stdout``, ``stderr`` and
``execution_time``; a top-level ``status`` of ``SandboxError`` means the server itself failed.
Results come back as the local sandbox's `SandboxResult` (``isolation=("remote",)``), so an
environment does not care where its code ran. Connection errors and HTTP 5xx are retried with
exponential backoff; what still fails is a ``sandbox_error`` result, never an exception.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from rlhf.sandbox import SandboxResult

RETRY_BASE_S = 0.5


@dataclass(kw_only=True)
class RemoteSandbox:
    """A client of one SandboxFusion-style endpoint."""

    url: str = field(metadata={"help": "server base URL; requests go to {url}/run_code"})
    request_timeout_s: float | None = field(default=None, metadata={"help": "per request; default run timeout + 30 s"})
    max_retries: int = field(default=2, metadata={"help": "retries after a connection error or HTTP 5xx"})
    max_output_bytes: int = field(default=1 << 20, metadata={"help": "characters kept per stream"})
    headers: dict[str, str] | None = field(default=None, metadata={"help": "extra HTTP headers (e.g. auth)"})

    async def run_code_async(self, code: str, *, stdin: str = "", timeout_s: float = 10.0,
                             memory_mb: int | None = None) -> SandboxResult:
        import aiohttp

        payload = {"code": code, "language": "python", "run_timeout": timeout_s, "compile_timeout": 10,
                   "memory_limit_MB": memory_mb if memory_mb is not None else -1, "stdin": stdin}
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s or timeout_s + 30)
        started, error = time.monotonic(), ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(RETRY_BASE_S * 2 ** (attempt - 1))
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    async with session.post(self.url.rstrip("/") + "/run_code", json=payload,
                                            headers=self.headers) as response:
                        if response.status >= 500:
                            error = f"HTTP {response.status}: {(await response.text())[:200]}"
                            continue
                        if response.status != 200:
                            error = f"HTTP {response.status}: {(await response.text())[:200]}"
                            break
                        data = await response.json(content_type=None)
                return self.parse(data, timeout_s, time.monotonic() - started)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        return SandboxResult(status="sandbox_error", message=f"remote sandbox {self.url}: {error}",
                             duration_s=time.monotonic() - started, isolation=("remote",))

    def run_code(self, code: str, **kwargs: Any) -> SandboxResult:
        """Blocking `run_code_async` (not from inside a running event loop)."""
        return asyncio.run(self.run_code_async(code, **kwargs))

    def parse(self, data: Any, timeout_s: float, duration_s: float) -> SandboxResult:
        """Turn a ``/run_code`` response into a `SandboxResult`."""
        if not isinstance(data, dict):
            return SandboxResult(status="sandbox_error", message=f"unexpected response {str(data)[:200]!r}",
                                 duration_s=duration_s, isolation=("remote",))
        run = data.get("run_result") or {}
        stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
        result = SandboxResult(
            status="ok", stdout=stdout[: self.max_output_bytes], stderr=stderr[: self.max_output_bytes],
            stdout_truncated=len(stdout) > self.max_output_bytes, stderr_truncated=len(stderr) > self.max_output_bytes,
            returncode=run.get("return_code"), duration_s=duration_s, isolation=("remote",),
        )
        run_status = run.get("status")
        if data.get("status") == "SandboxError" or not run:
            result.status = "sandbox_error"
            result.message = f"remote sandbox error: {str(data.get('message') or data)[:300]}"
        elif run_status == "TimeLimitExceeded":
            result.status, result.message = "timeout", f"wall-clock timeout: still running after {timeout_s:g} s"
        elif run_status != "Finished":
            result.status, result.message = "sandbox_error", f"remote run status {run_status!r}"
        elif result.returncode not in (0, None):
            last = stderr.strip().splitlines()[-1:] or [f"exit code {result.returncode}"]
            result.status = "killed" if result.returncode < 0 else "error"
            result.message = last[0][:300]
        return result
