"""CPU threads that stay fast on a machine other jobs share.

Two things make a torch process on a busy CPU 10-50x slower than on an idle one: more intra-op
threads than the cores free for them (every parallel op then waits for a thread that is not
scheduled), and OpenMP's default wait policy, whose idle threads spin for a while (GNU OpenMP:
300,000 rounds) before they sleep, burning the time slice the missing thread needs. So:

* `prepare_openmp` (before torch is imported: the ``rlhf`` command calls it first) lowers GNU
  OpenMP's spin count (``GOMP_SPINCOUNT``) unless the user set it or ``OMP_WAIT_POLICY``.
* `choose_threads` takes torch's default thread count (one per core) but no more than the cores
  other jobs leave free (`others_load`), at least one; ``--threads N`` overrides it.

Measured figures: benchmarks/README.md, "Threads".
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

# Spin rounds before an idle OpenMP thread sleeps (GNU OpenMP's default is 300,000, tens of ms on a
# descheduled sibling): short enough that a busy machine loses little, long enough that the ops of
# one forward, microseconds apart, still find their threads awake.
SPIN_COUNT = "10000"


def prepare_openmp(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set GNU OpenMP's spin count unless the user chose a wait policy; no effect once torch is imported."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def others_load(samples: int = 5, interval: float = 0.02) -> float | None:
    """How many cores other processes keep busy: the larger of the 1-minute load average and the
    runnable tasks now (median of a few looks at /proc/loadavg, less this thread), so that jobs
    started seconds ago count too. None where the system does not say."""
    try:
        average = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    running = []
    for index in range(samples):
        try:
            with open("/proc/loadavg") as handle:
                running.append(int(handle.read().split()[3].split("/")[0]) - 1)  # "R/T": runnable/total
        except (OSError, IndexError, ValueError):
            break
        if index + 1 < samples:
            time.sleep(interval)
    return max(average, statistics.median(running)) if running else average


def choose_threads(requested: int | None, default: int, *, cores: int | None = None,
                   load: float | None = None) -> int:
    """``requested`` when given, else ``default`` (torch's count) capped by the cores that ``load``
    (`others_load`) leaves free (rounded), at least 1."""
    if requested is not None:
        return requested
    if load is None:
        return default
    free = (cores if cores is not None else usable_cores()) - load
    return max(1, min(default, int(free + 0.5)))


def set_threads(requested: int | None) -> int:
    """Set torch's intra-op thread count (`choose_threads`) and return it."""
    import torch

    default = torch.get_num_threads()
    cores, load = usable_cores(), others_load()
    threads = choose_threads(requested, default, cores=cores, load=load)
    if threads != default:
        torch.set_num_threads(threads)
    if requested is None and threads < default:
        log.info("using %d CPU thread(s): other jobs keep %.1f of %d cores busy (--threads N to choose)",
                 threads, load, cores)
    return threads
