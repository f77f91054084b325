"""CPU threads that stay fast on a machine other jobs share.

Two things make a torch process on a busy CPU many times slower than on an idle one: more intra-op
threads than the cores free for them (every parallel op then waits for a thread that is not
scheduled), and OpenMP's default wait policy, whose idle threads spin for a while (GNU OpenMP:
300,000 rounds) before they sleep, burning the time slice the missing thread needs. So:

* `prepare_openmp` (before torch is imported: the ``rlhf`` command calls it first) lowers GNU
  OpenMP's spin count (``GOMP_SPINCOUNT``) unless the user set it or ``OMP_WAIT_POLICY``.
* `choose_threads` takes torch's default thread count (one per core) but no more than the cores
  other jobs leave free (`others_load`), at least one; ``--threads N`` overrides it. The
  training loops call `adjust_threads` between steps, so the count follows the load.

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


def own_running() -> int:
    """Threads of this process that are runnable now (OpenMP workers still spinning count)."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as handle:
                count += handle.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            pass
    return max(count, 1)


def others_load(samples: int = 10, interval: float = 0.02) -> float | None:
    """How many cores other processes keep busy now: the median, over a few looks at
    /proc/loadavg, of the tasks runnable less this process's. Runnable-now and not the load
    average, which trails by a minute: it still counts a job that just ended (this user's
    previous run) and not yet one that just began. Where /proc is missing, the load average;
    None where the system says neither."""
    running = []
    for index in range(samples):
        try:
            with open("/proc/loadavg") as handle:
                total = int(handle.read().split()[3].split("/")[0])  # "R/T": runnable/total
        except (OSError, IndexError, ValueError):
            break
        running.append(max(total - own_running(), 0))
        if index + 1 < samples:
            time.sleep(interval)
    if running:
        return float(statistics.median(running))
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


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


class ThreadGovernor:
    """Chooses the thread count again between steps, as other jobs start and end: a run that
    began on an idle machine drops to fewer threads when others arrive, and comes back. Called
    on the thread that runs torch (OpenMP's thread count is per calling thread)."""

    def __init__(self, default: int, cores: int, load: float):
        self.default, self.cores, self.load = default, cores, load

    def adjust(self) -> int:
        # One look, no sleep: the smoothing over steps steadies it, and a step waits for nothing
        # (three looks 2 ms apart cost 4 ms of every step's wall clock: 6% on the tiny benchmark).
        now = others_load(samples=1)
        if now is None:
            return self.current()
        self.load = 0.5 * self.load + 0.5 * now  # smoothed over steps: no flapping on one look
        threads = choose_threads(None, self.default, cores=self.cores, load=self.load)
        if threads != self.current():
            import torch

            torch.set_num_threads(threads)
            log.info("now %d CPU thread(s): other jobs keep %.1f of %d cores busy", threads, self.load, self.cores)
        return threads

    @staticmethod
    def current() -> int:
        import torch

        return torch.get_num_threads()


_governor: ThreadGovernor | None = None


def set_threads(requested: int | None) -> int:
    """Set torch's intra-op thread count (`choose_threads`) and return it. Without ``requested``
    (``--threads``, else the environment variable ``RLHF_THREADS``) the count follows the load
    from then on (`adjust_threads` between steps)."""
    global _governor
    import torch

    if requested is None and os.environ.get("RLHF_THREADS", "").strip():
        try:
            requested = max(1, int(os.environ["RLHF_THREADS"]))
        except ValueError:
            from rlhf.core.errors import ConfigError

            raise ConfigError(f"RLHF_THREADS must be a number of threads, got {os.environ['RLHF_THREADS']!r}") from None

    default = torch.get_num_threads()
    cores, load = usable_cores(), others_load()
    threads = choose_threads(requested, default, cores=cores, load=load)
    if threads != default:
        torch.set_num_threads(threads)
    if requested is None and threads < default:
        log.info("using %d CPU thread(s): other jobs keep %.1f of %d cores busy (--threads N to choose)",
                 threads, load, cores)
    _governor = ThreadGovernor(default, cores, load) if requested is None and load is not None else None
    return threads


def adjust_threads() -> None:
    """Between steps: follow the load (after `set_threads` without a count; otherwise nothing)."""
    if _governor is not None:
        _governor.adjust()
