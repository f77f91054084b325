"""The agent contract: a function, sync or ``async``, that solves one dataset row by talking to the
policy through an OpenAI-compatible endpoint of its own (docs/agents.md).

    def solve(sample: dict, endpoint: Endpoint) -> float | AgentResult | None

``sample`` is the dataset row (every column; the ``--input-key`` column as given: a string or chat
messages). ``endpoint`` belongs to this one call (this one trajectory): its ``base_url`` is an
OpenAI-compatible ``.../v1`` URL, ``api_key`` its key, ``model`` the name to send. What the agent
returns is the trajectory's reward: a number, an `AgentResult` (a reward and an ``info`` dict), or
``None``, and then the run's ``--reward`` sources score the trajectory.

Settings: every agent has `AgentConfig`'s (``--agent.timeout-s``); an agent with settings of its own
registers a ``config_cls`` that subclasses it and takes it as a third argument,
``solve(sample, endpoint, config)``.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class AgentConfig:
    """Settings every agent has (an agent's own config class subclasses it)."""

    timeout_s: float = field(default=600.0, metadata={
        "help": "seconds one agent call may take; a call still running then is a failed trajectory (outcome "
                "timeout)"})

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            from rlhf.core.errors import ConfigError

            raise ConfigError(f"--agent.timeout-s must be positive, got {self.timeout_s}")


@dataclass(frozen=True)
class Endpoint:
    """Where one agent call reaches the policy: an OpenAI-compatible ``/v1`` URL of its own."""

    base_url: str  # http://127.0.0.1:PORT/t/<trajectory>/v1
    api_key: str
    model: str  # the model name to send

    def openai(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client configured for this endpoint (needs the ``openai`` package). The
        clients share one HTTP connection pool per process (building one costs ~20 ms of CPU, and a
        batch makes one client per trajectory); pass ``http_client=`` for your own."""
        openai = _openai_module()
        if "http_client" not in kwargs:
            kwargs["http_client"] = _shared_http("sync", openai.DefaultHttpxClient)
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def async_openai(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client configured for this endpoint (needs the ``openai`` package),
        sharing one connection pool per event loop (pass ``http_client=`` for your own)."""
        import asyncio

        openai = _openai_module()
        if "http_client" not in kwargs:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                kwargs["http_client"] = _shared_http(loop, openai.DefaultAsyncHttpxClient)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


@dataclass(frozen=True)
class AgentResult:
    """An agent's verdict on its own trajectory: a reward (None: the ``--reward`` sources score it)
    and anything worth keeping with the trajectory (``info``, written to samples.jsonl)."""

    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


def as_agent_result(value: Any) -> AgentResult:
    """What an agent returned as an `AgentResult`; a TypeError for anything else, a ValueError for a
    reward that is not finite (NaN is not a reward: the call failed)."""
    if isinstance(value, AgentResult):
        result = value
    elif value is None:
        result = AgentResult()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = AgentResult(reward=float(value))
    else:
        raise TypeError(f"an agent returns a float, an AgentResult or None, not {type(value).__name__}")
    if result.reward is not None and not math.isfinite(float(result.reward)):
        raise ValueError(f"the agent returned a reward that is not a finite number: {result.reward}")
    return result


_HTTP_CLIENTS: weakref.WeakKeyDictionary | None = None  # event loop -> its async pool
_SYNC_HTTP: list[Any] = []  # the process's sync pool, once made
_HTTP_LOCK = threading.Lock()


def _shared_http(key: Any, make: Any) -> Any:
    """One HTTP client per process (``key`` "sync") or per event loop: an async client's connections
    belong to the loop that opened them."""
    global _HTTP_CLIENTS
    with _HTTP_LOCK:
        if key == "sync":
            if not _SYNC_HTTP:
                _SYNC_HTTP.append(make())
            return _SYNC_HTTP[0]
        if _HTTP_CLIENTS is None:
            _HTTP_CLIENTS = weakref.WeakKeyDictionary()
        client = _HTTP_CLIENTS.get(key)
        if client is None:
            client = _HTTP_CLIENTS[key] = make()
        return client


def _openai_module() -> Any:
    try:
        import openai
    except ImportError:
        raise ImportError("Endpoint.openai() needs the openai package: pip install openai (or point any "
                          "OpenAI-compatible client at endpoint.base_url with endpoint.api_key)") from None
    return openai
