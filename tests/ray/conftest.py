"""One local Ray cluster for the whole session (``ray.init`` costs seconds): 2 logical CPUs, files
under the session's ``RAY_TMPDIR``, auth tokens off (tests/conftest.py), no dashboard. The runs
in these tests join it and leave it up; their actors use fractions of a CPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    assert os.environ.get("RAY_AUTH_MODE") == "disabled" and os.environ.get("RAY_TMPDIR"), "set by tests/conftest.py"
    if ray.is_initialized():  # another test folder's session cluster
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()
