"""Memory limit of a whole sandboxed tree where no memory cgroup exists (``memory_watchdog``).

Used by ``_sandbox_child.py`` (standard library only). Every ``TICK_S`` while the supervisor
waits, a timer signal sums the proportional set size (PSS: shared pages split between their
users, so forked children are not counted twice) of every process below the supervisor; over
the limit, it kills them all and the call ends ``killed`` naming the limit. A poll, not a
kernel limit: a tree can overshoot for up to one tick (RLIMIT_AS still bounds each process).
"""

import _signal as signal
import os

TICK_S = 0.05
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def descendants(root):
    """Pids below ``root`` (from /proc: in a pid namespace, only the sandbox's)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            parent[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
    out, frontier = [], [root]
    while frontier:
        here = frontier.pop()
        kids = [p for p, pp in parent.items() if pp == here]
        out += kids
        frontier += kids
    return out


def memory_of(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


class MemoryWatchdog:
    def __init__(self, limit_bytes):
        self.limit, self.exceeded, self.me = limit_bytes, False, os.getpid()

    def start(self):
        signal.signal(signal.SIGALRM, self.tick)
        signal.setitimer(signal.ITIMER_REAL, TICK_S, TICK_S)

    def stop(self):
        signal.setitimer(signal.ITIMER_REAL, 0, 0)

    def tick(self, signum, frame):
        pids = descendants(self.me)
        if sum(memory_of(p) for p in pids) > self.limit:
            self.exceeded = True
            self.stop()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
