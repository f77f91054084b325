"""The reward server fixture of the ``rlhf reward serve`` tests: ``serve(source, token=..., **limits)``
starts one in a thread and stops it after the test."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.limits import ServerLimits
from rlhf.rewards.server import RewardServer


@pytest.fixture
def serve():
    servers: list[RewardServer] = []

    def start(source: Any = None, token: str | None = None, **limits: Any) -> str:
        """Serve ``source`` (default: 1.0 for every sample) in a thread; its URL."""
        source = source or FunctionSource(lambda completions: [1.0] * len(completions), "ones", "ones")
        server = RewardServer(source, host="127.0.0.1", port=0, token=token, limits=ServerLimits(**limits))
        url = server.start()
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        return url

    yield start
    for server in servers:
        server.stop()
