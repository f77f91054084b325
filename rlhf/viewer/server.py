"""``rlhf view``'s local server (docs/runs.md): the standard library's HTTP server, no torch.

What it guards:

* it listens on 127.0.0.1 only, and answers only requests addressed to that host or
  ``localhost`` with its port (a page elsewhere cannot reach it through a DNS name of its own);
* every request carries the session's token, a random one per start: ``?token=`` in the URL the
  command prints (the page passes it on), or the cookie the page's first answer sets; without it,
  403 and nothing else;
* it serves one page and a few JSON answers about the runs it was given, addressed by their
  number: no request names a file, so none can reach another (``/../`` and the like are 404);
* the page carries a Content-Security-Policy that lets only its own inline code run (a nonce per
  answer) and connects nowhere but here.

Routes (GET): ``/`` the page; ``/api/runs``; ``/api/metrics?run=I&from=N&keys=K,...``;
``/api/steps?run=I``; ``/api/step?run=I&step=S``; ``/api/prompt?prompt=TEXT`` (the same prompt
in every run, at every step). The page polls ``/api/metrics`` every 2 s with ``from`` the rows it
has, and the server reads only the bytes appended since (`rlhf.viewer.logs`).
"""

from __future__ import annotations

import hmac
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rlhf.viewer.page import render, to_json
from rlhf.viewer.runs import CHART_METRICS, Run

COOKIE = "rlhf_view_token"
HOST = "127.0.0.1"


class ViewServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, runs: list[Run], port: int = 0, token: str | None = None):
        self.runs = runs
        self.token = token or secrets.token_urlsafe(24)
        super().__init__((HOST, port), Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/?token={self.token}"

    def start(self) -> threading.Thread:
        """Serve on a daemon thread (tests; the command serves in the foreground)."""
        thread = threading.Thread(target=self.serve_forever, daemon=True, name="rlhf-view")
        thread.start()
        return thread


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Handler(BaseHTTPRequestHandler):
    server: ViewServer
    server_version = "rlhf-view"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: the command prints its URL and nothing per request

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        try:
            self._check_host()
            parts = urlsplit(self.path)
            query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
            given = self._check_token(query)
            if parts.path == "/":
                self._page(set_cookie=given == "query")
            elif parts.path.startswith("/api/"):
                self._json(self._api(parts.path[len("/api/"):], query))
            else:
                raise _Refused(404, "not found")
        except _Refused as refused:
            self._send(refused.status, "text/plain; charset=utf-8", (refused.message + "\n").encode())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_POST(self) -> None:  # noqa: N802
        self._send(405, "text/plain; charset=utf-8", b"the viewer only reads\n")

    do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

    # --- checks ---------------------------------------------------------------------------------

    def _check_host(self) -> None:
        host = (self.headers.get("Host") or "").lower()
        if host not in (f"{HOST}:{self.server.port}", f"localhost:{self.server.port}"):
            raise _Refused(403, "this server answers only requests to 127.0.0.1 or localhost")

    def _check_token(self, query: dict[str, str]) -> str:
        """``query`` or ``cookie``: where the request's valid token was; refuses one without."""
        expected = self.server.token.encode()
        if hmac.compare_digest(query.get("token", "").encode(), expected):
            return "query"
        for part in (self.headers.get("Cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE and hmac.compare_digest(value.encode(), expected):
                return "cookie"
        raise _Refused(403, "forbidden: open the URL rlhf view printed (it holds this session's token)")

    # --- answers --------------------------------------------------------------------------------

    def _run(self, query: dict[str, str]) -> Run:
        try:
            return self.server.runs[int(query.get("run", "0"))]
        except (ValueError, IndexError):
            raise _Refused(404, "no such run") from None

    def _int(self, query: dict[str, str], name: str, default: int | None = None) -> int:
        try:
            return int(query[name]) if name in query or default is None else default
        except (KeyError, ValueError):
            raise _Refused(400, f"{name} must be a number") from None

    def _api(self, route: str, query: dict[str, str]) -> Any:
        if route == "runs":
            return {"runs": [run.summary() for run in self.server.runs], "charts": list(CHART_METRICS)}
        if route == "metrics":
            keys = [k for k in query.get("keys", "").split(",") if k] or list(CHART_METRICS)
            return self._run(query).metrics.columns(keys[:64], max(0, self._int(query, "from", 0)))
        if route == "steps":
            return {"steps": self._run(query).steps()}
        if route == "step":
            return self._run(query).step(self._int(query, "step"))
        if route == "prompt":
            prompt = query.get("prompt", "")
            return {"runs": [run.same_prompt(prompt) for run in self.server.runs]}
        raise _Refused(404, "not found")

    def _page(self, *, set_cookie: bool) -> None:
        nonce = secrets.token_urlsafe(16)
        boot = {"mode": "live", "token": self.server.token}
        headers = {"Content-Security-Policy": (f"default-src 'none'; script-src 'nonce-{nonce}'; "
                                               f"style-src 'nonce-{nonce}'; connect-src 'self'; img-src data:; "
                                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")}
        if set_cookie:
            headers["Set-Cookie"] = f"{COOKIE}={self.server.token}; HttpOnly; SameSite=Strict; Path=/"
        self._send(200, "text/html; charset=utf-8", render(boot, nonce=nonce).encode(), headers)

    def _json(self, data: Any) -> None:
        body = to_json(data).encode()
        self._send(200, "application/json", body)

    def _send(self, status: int, kind: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)
