"""CPU threads: a count fixed by the machine, so the same command gives the same bits, and one that
stays fast on a machine other jobs share.

torch sums floats in an order that depends on its thread count, so a run's numbers (losses, KL,
weights, in the last bits) follow the count. The default is therefore fixed by the machine, never
by its load: `default_threads`, half the cores this process may use (at least one; all of what
``OMP_NUM_THREADS`` says where it is set). Half, because a thread per core stalls every parallel op
whenever another process takes one of those cores, while a thread left out costs little on the
small products of a CPU run (figures in benchmarks/README.md, "Trust under faults"). The count a run used is recorded in its config.yaml
and a ``--resume`` without ``--threads`` reuses it.

* `prepare_openmp` (before torch is imported: the ``rlhf`` command calls it first) lowers GNU
  OpenMP's spin count (``GOMP_SPINCOUNT``) unless the user set it or ``OMP_WAIT_POLICY``: idle
  threads then yield their core sooner to a thread that is waiting for it.
* ``--threads N`` (or ``RLHF_THREADS=N``) chooses the count; ``--threads auto`` follows the load
  instead: torch's default count capped by the cores other jobs leave free (`others_load`),
  chosen again between steps (`adjust_threads`). It is the fastest on a machine whose load moves,
  and its results are not bit-reproducible.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Mapping, MutableMapping

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
        # (three looks a few ms apart would add their wait to every step's wall clock).
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


AUTO = "auto"


def default_threads(cores: int | None = None, environ: Mapping[str, str] = os.environ) -> int:
    """The count a run uses without ``--threads``: ``OMP_NUM_THREADS`` where set, else half the
    ``cores`` (`usable_cores`), at least 1. A function of the machine alone."""
    return _omp_threads(environ) or max(1, (cores if cores is not None else usable_cores()) // 2)


def _omp_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    wanted = environ.get("OMP_NUM_THREADS", "").strip()
    return int(wanted) if wanted.isdigit() and int(wanted) > 0 else None


def requested_threads(value: int | str | None, environ: Mapping[str, str] = os.environ) -> int | str | None:
    """``--threads`` as given, else ``RLHF_THREADS``: a count, `AUTO`, or None (the default)."""
    from rlhf.core.errors import ConfigError

    if value is None:
        value = environ.get("RLHF_THREADS", "").strip() or None
        if value is None:
            return None
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or isinstance(value, bool):
        raise ConfigError(f"--threads (or RLHF_THREADS) must be a number of threads of at least 1, or auto; got "
                          f"{value!r}")
    return count


def set_threads(requested: int | str | None) -> int | str:
    """Set torch's intra-op thread count for this process and return what the run records: the
    count, or `AUTO` when it follows the load (`adjust_threads` between steps from then on)."""
    global _governor
    import torch

    requested = requested_threads(requested)
    _governor = None
    if requested == AUTO:
        cores, load = usable_cores(), others_load()
        default = _omp_threads() or cores  # torch's own default: one per core
        threads = choose_threads(None, default, cores=cores, load=load)
        torch.set_num_threads(threads)
        log.info("--threads auto: %d CPU thread(s) now, following the load (results are not bit-reproducible)",
                 threads)
        _governor = ThreadGovernor(default, cores, load) if load is not None else None
        return AUTO
    threads = requested if requested is not None else default_threads()
    torch.set_num_threads(threads)
    if requested is None:
        log.info("using %d CPU thread(s), fixed for this machine (--threads N to choose, --threads auto to follow "
                 "the load)", threads)
    return threads


def adjust_threads() -> None:
    """Between steps: follow the load (after ``set_threads("auto")``; otherwise nothing)."""
    if _governor is not None:
        _governor.adjust()


def split_threads(total: int, staleness: int) -> tuple[int, int]:
    """``--async``'s torch threads: ``(producer, trainer)`` out of the run's ``total``.

    With staleness 0 the two sides take turns (the producer waits for every step), so each gets the
    whole count, as in a synchronous run (whose bits it reproduces). Otherwise they run at once:
    the producer gets half (at least one) and the trainer the rest, so together they use the
    run's count, not twice it; with a count of one each side keeps one (two in all, which the
    default count, half the cores, leaves room for). Set per thread: OpenMP's count is
    per calling thread, and a thread that never sets it uses one per core, beside the trainer's."""
    if staleness == 0 or total <= 1:
        return total, total
    producer = total // 2
    return producer, total - producer
