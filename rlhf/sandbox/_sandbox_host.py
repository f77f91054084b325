"""Host-side helpers of ``rlhf.sandbox``: the Python layout to keep visible, the
one-time warning about missing isolation layers, signal messages and killing a sandbox uid.
Standard library only."""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import time
import warnings
from typing import Any

from ._sandbox_view import python_layout

EXPECTED_LAYERS = ("pid_ns", "net_ns", "mount_ns", "readonly_fs", "minimal_dev", "proc_sys_ro", "seccomp",
                   "cgroup_memory", "cgroup_pids")
_warned: set[tuple[str, ...]] = set()


def _warn_missing_layers(start: dict[str, Any], cfg: Any) -> None:
    """Warn once per process for each set of isolation layers this machine could not provide
    (layers the config turned off are not warned about)."""
    if not start:
        return
    layers = set(start.get("isolation", ()))
    off = {"seccomp"} if cfg.seccomp is False else set()
    off |= {"cgroup_memory", "cgroup_pids"} if cfg.cgroup is False else set()
    off |= {"pid_ns", "net_ns", "mount_ns", "readonly_fs", "minimal_dev", "proc_sys_ro"} if cfg.namespaces is False else set()
    missing = [name for name in EXPECTED_LAYERS if name not in layers and name not in off]
    if os.geteuid() == 0 and not {"uid", "user_ns"} & layers and cfg.drop_privileges is not False:
        missing.append("uid")
    key = tuple(missing)
    if missing and key not in _warned:
        _warned.add(key)
        notes = "; ".join(start.get("notes", ()))
        warnings.warn(f"rlhf sandbox: isolation layers not available on this machine: {', '.join(missing)}"
                      f"{f' ({notes})' if notes else ''}; active: {', '.join(sorted(layers))}",
                      RuntimeWarning, stacklevel=4)


@functools.lru_cache(maxsize=1)
def _python_layout() -> dict[str, list[str]]:
    """This interpreter's installation (kept visible to the code), its site-packages and its
    editable installs (``_sandbox_view.python_layout``; the supervisor computes the same itself
    when it runs another interpreter)."""
    return python_layout(sys)


def _signal_message(signum: int, cpu_s: float | None, cfg: Any) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    cpu_limit = cfg.cpu_time_s or math.ceil(cfg.timeout_s) + 1
    if signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_s is not None and cpu_s >= cpu_limit - 0.5):
        return f"killed by {name}: CPU time limit ({cpu_limit} s)"
    if signum == signal.SIGXFSZ:
        return f"killed by {name}: file size limit ({cfg.max_file_size_mb} MiB)"
    if signum == signal.SIGSEGV:
        return f"killed by {name}: the process crashed (memory limit {cfg.memory_mb} MiB?)"
    return f"killed by {name}"


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (the per-call sandbox uid) until none is left."""
    for _ in range(100):
        pids = []
        for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
            try:
                if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                    pids.append(int(name))
            except OSError:
                continue
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
