"""One local Ray cluster for the tests of this folder (``ray.init`` costs seconds): 2 logical CPUs,
files under the session's ``RAY_TMPDIR``, auth tokens off (tests/conftest.py), no dashboard. The
runs in these tests join it and leave it up; their actors use fractions of a CPU. It stops after
the folder's last test (`pytest -n 2` runs the folder on one worker, one file after another): an
idle cluster's processes would take a few percent of a core from the tests that follow."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="package")
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
