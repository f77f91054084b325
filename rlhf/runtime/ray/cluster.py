"""The Ray connection of a run: join a cluster, or start a local one, and leave nothing behind.

* Ray already initialised in this process (a notebook, the tests): the run uses that connection
  and leaves it up.
* ``--ray-address`` (or, without it, Ray's own ``RAY_ADDRESS`` variable): the run connects to that
  cluster and ships the current directory to the workers as their working directory (Ray's
  ``runtime_env``), so relative paths and ``file.py:attr`` references work there; it disconnects at the end. What is shipped, and the
  size check before it: rlhf/runtime/ray/shipping.py.
* Otherwise the run starts a local cluster (no dashboard) with enough logical CPUs for the
  requested actors, and shuts it down at the end, even after an error or Ctrl-C.

Ray's files go to ``RAY_TMPDIR`` when set (else Ray's default, /tmp/ray). Ray 2.5x writes an
auth token to ``~/.ray`` unless ``RAY_AUTH_MODE=disabled`` (the tests set both).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError

log = logging.getLogger(__name__)

from rlhf.runtime.ray.shipping import SHIPPING_EXCLUDES, check_size, runtime_excludes  # noqa: F401 - re-exported


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("--runtime ray needs Ray: pip install 'rlhf-core[ray]'") from exc
    return ray


def job_runtime_env(config: Any, cwd: Path, out_dir: Path) -> dict[str, Any]:
    """The job-level ``runtime_env``: the working directory when joining a cluster by address."""
    if not config.ray_address:
        return {}
    excludes = runtime_excludes(config, cwd, out_dir)
    check_size(cwd, excludes)  # before Ray zips it: a clear error naming what is big
    return {"working_dir": str(cwd), "excludes": excludes}


@dataclass
class Cluster:
    """What this run opened, so `close` undoes exactly that."""

    started: bool  # a local cluster this run started (shut down at the end)
    connected: bool  # a connection this run opened (closed at the end)
    ships_working_dir: bool
    seconds: float = 0.0  # time to start or join
    cleanups: list[Any] = field(default_factory=list)  # callables, run in reverse order by `close`

    @classmethod
    def open(cls, config: Any, *, cpus_needed: float, gpus_needed: float, out_dir: Path) -> Cluster:
        ray = import_ray()
        began = time.perf_counter()
        if not config.ray_address and os.environ.get("RAY_ADDRESS"):  # Ray would join it, refusing num_cpus
            config = dataclasses.replace(config, ray_address=os.environ["RAY_ADDRESS"])
        if ray.is_initialized():
            cluster = cls(started=False, connected=False, ships_working_dir=False)
        elif config.ray_address:
            ray.init(address=config.ray_address, runtime_env=job_runtime_env(config, Path.cwd(), out_dir),
                     logging_level=logging.WARNING)
            cluster = cls(started=False, connected=True, ships_working_dir=True)
        else:
            if gpus_needed > 0:
                import torch

                visible = torch.cuda.device_count()
                if visible < math.ceil(gpus_needed):
                    raise ConfigError(f"the run's actors need {gpus_needed:g} GPUs but this machine has {visible}: "
                                      "lower --*-gpus, or join a cluster with --ray-address")
            # Logical CPUs are scheduling tokens: declare enough for every requested actor, at least the cores.
            cpus = max(os.cpu_count() or 1, math.ceil(cpus_needed))
            ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
            cluster = cls(started=True, connected=True, ships_working_dir=False)
        cluster.seconds = time.perf_counter() - began
        log.info("Ray: %s in %.1f s", "started a local cluster" if cluster.started else
                 "connected to " + config.ray_address if cluster.connected else "using this process's connection",
                 cluster.seconds)
        return cluster

    def close(self) -> None:
        import ray

        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception as exc:  # cleanup must go on: the next step may free what this one could not
                log.warning("Ray cleanup step failed: %s: %s", type(exc).__name__, exc)
        self.cleanups.clear()
        if self.connected and ray.is_initialized():
            ray.shutdown()  # stops the local cluster when this run started it
