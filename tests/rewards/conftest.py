"""The reward server fixture of the ``rlhf reward serve`` tests."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.server import RewardServer, ServerLimits


@pytest.fixture
def serve():
    servers: list[RewardServer] = []

    def start(source: Any = None, **limits: Any) -> str:
        source = source or FunctionSource(lambda completions: [1.0] * len(completions), "ones", "ones")
        server = RewardServer(source, host="127.0.0.1", port=0, limits=ServerLimits(**limits))
        url = server.start()
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        return url

    yield start
    for server in servers:
        server.stop()
