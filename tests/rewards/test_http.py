"""Remote rewards over OpenRLHF's HTTP protocol: against a stdlib server that misbehaves on purpose
(nothing hangs, retries are bounded, the policy is followed, errors are clear) and against
`rlhf reward serve` itself. Loopback and ephemeral ports only; short timeouts."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rlhf.rewards.combine import RewardSet
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.remote import HttpSource
from rlhf.rewards import RewardConfigError, RewardError, load_reward

pytestmark = pytest.mark.unit

FAST = dict(retries=2, backoff_s=0.01, backoff_max_s=0.02, timeout_s=0.5)


class Misbehaving(ThreadingHTTPServer):
    """Answers by path: /ok, /flaky (two 500s first), /500, /slow, /malformed, /short, /drop, /nan,
    /scalar, /nested, /auth (needs 'Bearer s3cret'); anything else 404."""

    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.sizes: list[int] = []
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.peak = 0
        self.release = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that gave up (timeouts) break the pipe on purpose


class Handler(BaseHTTPRequestHandler):
    server: Misbehaving

    def log_message(self, *args: Any) -> None:
        pass

    def reply(self, status: int, body: bytes | str) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server, path = self.server, self.path
        with server.lock:
            count = server.requests[path] = server.requests.get(path, 0) + 1
            server.sizes.append(len(body["query"]))
            server.bodies.append(body)
            server.in_flight += 1
            server.peak = max(server.peak, server.in_flight)
        try:
            self.answer(path, count, body)
        finally:
            with server.lock:
                server.in_flight -= 1

    def answer(self, path: str, count: int, body: dict[str, Any]) -> None:
        lengths = [float(len(q) - len(p)) for q, p in zip(body["query"], body["prompts"])]
        ok = json.dumps({"rewards": lengths, "scores": [1.0] * len(lengths), "extra_logs": {"n": lengths}})
        if path == "/ok" or (path == "/flaky" and count > 2):
            self.reply(200, ok)
        elif path == "/paced":
            time.sleep(0.05)
            self.reply(200, ok)
        elif path in ("/500", "/flaky"):
            self.reply(500, "boom: verifier crashed")
        elif path == "/slow":
            self.server.release.wait(10)
            self.reply(200, ok)
        elif path == "/malformed":
            self.reply(200, "{not json")
        elif path == "/short":
            self.reply(200, json.dumps({"rewards": lengths[:-1]}))
        elif path == "/drop":
            self.close_connection = True  # no response at all
        elif path == "/nan":
            self.reply(200, json.dumps({"rewards": [float("nan")] + lengths[1:]}))
        elif path == "/scalar":
            self.reply(200, json.dumps({"rewards": 0.7, "scores": 1}))
        elif path == "/nested":
            self.reply(200, json.dumps({"rewards": [[v] for v in lengths]}))
        elif path == "/auth":
            if self.headers.get("Authorization") == "Bearer s3cret":
                self.reply(200, ok)
            else:
                self.reply(401, '{"error": "unauthorized"}')
        else:
            self.reply(404, "not here")


@pytest.fixture
def bad_server():
    servers: list[Misbehaving] = []

    def make() -> Misbehaving:
        server = Misbehaving()
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.release.set()
        server.shutdown()
        server.server_close()


def http(urls: str | list[str], on_error: str = "zero", **options: Any) -> RewardSet:
    urls = [urls] if isinstance(urls, str) else urls
    source = HttpSource(urls, "server", RewardOptions(on_error=on_error, **{**FAST, **options}))
    return RewardSet([source], on_error=on_error)


PROMPTS = ["Q: one ", "Q: two ", "Q: three "]
COMPLETIONS = ["a", "bb", "ccc"]


def test_protocol_body_and_scores(bad_server):
    server = bad_server()
    result = http(server.url + "/ok").score(PROMPTS, COMPLETIONS, ["x", {"k": 1}, None])
    assert result.total == [1.0, 2.0, 3.0]
    assert result.metrics["reward/server/n"] == 2.0 and result.metrics["reward/server/score"] == 1.0
    assert server.bodies == [{"query": ["Q: one a", "Q: two bb", "Q: three ccc"], "prompts": PROMPTS,
                              "labels": ["x", {"k": 1}, None]}]


def test_batches_and_concurrency_bound(bad_server):
    server = bad_server()
    result = http(server.url + "/paced", http_batch_size=2, concurrency=2).score(["p"] * 7, ["x"] * 7)
    assert result.total == [1.0] * 7
    assert sorted(server.sizes) == [1, 2, 2, 2]
    assert server.peak <= 2


def test_several_urls_share_the_load(bad_server):
    first, second = bad_server(), bad_server()
    result = http([first.url + "/ok", second.url + "/ok"], http_batch_size=1).score(["p"] * 8, ["xy"] * 8)
    assert result.total == [2.0] * 8
    assert first.requests == {"/ok": 4} and second.requests == {"/ok": 4}


def test_a_dead_url_fails_over_to_the_next(bad_server):
    server = bad_server()
    dead = bad_server()
    dead_url = dead.url
    dead.shutdown()
    dead.server_close()
    result = http([dead_url + "/ok", server.url + "/ok"], http_batch_size=1).score(["p"] * 4, ["x"] * 4)
    assert result.total == [1.0] * 4
    assert result.metrics["reward/failures"] == 0.0


def test_retries_are_bounded_and_the_policy_is_followed(bad_server):
    server = bad_server()
    result = http(server.url + "/500", on_error="zero").score(PROMPTS, COMPLETIONS)
    assert result.total == [0.0, 0.0, 0.0]
    assert server.requests == {"/500": 3}  # 1 attempt + 2 retries
    assert result.metrics["reward/failures/server"] == 3.0
    message = result.first_error.message
    assert "after 3 attempt(s)" in message and "HTTP 500" in message and "boom: verifier crashed" in message


def test_transient_errors_are_retried(bad_server):
    server = bad_server()
    result = http(server.url + "/flaky", on_error="raise").score(PROMPTS, COMPLETIONS)
    assert result.total == [1.0, 2.0, 3.0]
    assert server.requests == {"/flaky": 3}


def test_slow_server_times_out_instead_of_hanging(bad_server):
    server = bad_server()
    result = http(server.url + "/slow", on_error="skip", retries=1, timeout_s=0.3).score(PROMPTS, COMPLETIONS)
    assert result.total == [None, None, None]
    assert server.requests == {"/slow": 2}
    assert result.first_error.reason == "timeout" and "within 0.3 s" in result.first_error.message


@pytest.mark.parametrize("path, text", [
    ("/malformed", "response is not JSON"),
    ("/short", "'rewards' has 2 values for 3 samples"),
    ("/drop", "ServerDisconnectedError"),
])
def test_bad_responses_are_failures_and_retried(bad_server, path, text):
    server = bad_server()
    result = http(server.url + path).score(PROMPTS, COMPLETIONS)
    assert result.total == [0.0, 0.0, 0.0]
    assert server.requests == {path: 3}
    assert text in result.first_error.message


def test_non_finite_reward_fails_its_sample_without_retry(bad_server):
    server = bad_server()
    result = http(server.url + "/nan", on_error="skip").score(PROMPTS, COMPLETIONS)
    assert result.total == [None, 2.0, 3.0]
    assert server.requests == {"/nan": 1}
    assert result.first_error.reason == "not finite"


def test_client_errors_are_not_retried(bad_server):
    server = bad_server()
    result = http(server.url + "/missing").score(PROMPTS, COMPLETIONS)
    assert server.requests == {"/missing": 1}
    assert "HTTP 404" in result.first_error.message


def test_raise_policy_names_the_url_and_the_sample(bad_server):
    server = bad_server()
    with pytest.raises(RewardError, match=r"(?s)/500.*failed on sample 0.*HTTP 500.*'Q: one '"):
        http(server.url + "/500", on_error="raise").score(PROMPTS, COMPLETIONS)


def test_openrlhf_scalar_and_nested_answers(bad_server):
    server = bad_server()
    assert http(server.url + "/scalar").score(["p"], ["c"]).total == [0.7]
    assert http(server.url + "/nested").score(PROMPTS, COMPLETIONS).total == [1.0, 2.0, 3.0]


def test_bearer_token_from_the_environment(bad_server, monkeypatch):
    server = bad_server()
    monkeypatch.delenv("RLHF_REWARD_TOKEN", raising=False)
    assert http(server.url + "/auth").score(["p"], ["c"]).total == [0.0]  # 401, not retried
    assert server.requests == {"/auth": 1}
    monkeypatch.setenv("RM_TOKEN", "s3cret")
    assert http(server.url + "/auth", token_env="RM_TOKEN").score(["p"], ["c"]).total == [1.0]
    monkeypatch.setenv("RLHF_REWARD_TOKEN", "s3cret")
    assert http(server.url + "/auth").score(["p"], ["c"]).total == [1.0]


def test_named_token_variable_must_be_set(monkeypatch):
    monkeypatch.delenv("NOT_SET_TOKEN", raising=False)
    with pytest.raises(RewardConfigError, match="NOT_SET_TOKEN"):
        load_reward("http://127.0.0.1:9/x", token_env="NOT_SET_TOKEN")
