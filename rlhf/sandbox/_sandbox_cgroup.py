"""Memory and process limits on a whole sandboxed process tree, through a cgroup per call.

Host side of ``rlhf.sandbox`` (standard library only). RLIMIT_AS bounds one
process and RLIMIT_NPROC counts a uid's processes; a cgroup bounds the sum over every process the
code starts. `create` makes one cgroup for a call (v2: ``memory.max``, ``memory.swap.max``,
``pids.max`` under ``<cgroup2 mount>/rlhf-sandbox``; v1: ``memory.limit_in_bytes`` and
``pids.max`` under this process's own v1 cgroups); `join` moves the supervisor in (the host
does it while the supervisor's interpreter starts, before the supervisor reads its request, so
before it forks anything: a v1 memory cgroup migration can take 15 ms); `remove` deletes the
cgroup after the call. A host killed mid-call cannot remove its cgroups: the first `discover` of the
next process removes every per-call cgroup whose host process is gone (`remove_stale`). Where no
writable hierarchy with the controller exists, the layer is missing and the caller says so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

V2_PARENT = "rlhf-sandbox"
_PREFIX = "rlhf-sandbox-"  # a call's cgroup: rlhf-sandbox-<host pid>-<random>
_discovered: dict[str, tuple[str, str] | None] | None = None  # controller -> (version, directory)


@dataclass
class Cgroup:
    dirs: list[str] = field(default_factory=list)
    procs: list[str] = field(default_factory=list)  # cgroup.procs files the supervisor joins
    layers: list[str] = field(default_factory=list)  # "cgroup_memory", "cgroup_pids"
    memory_dir: str | None = None
    memory_version: str | None = None

    def oom_killed(self) -> bool:
        """Did the kernel kill a process of this cgroup for memory?"""
        if self.memory_dir is None:
            return False
        name = "memory.events" if self.memory_version == "v2" else "memory.oom_control"
        try:
            with open(os.path.join(self.memory_dir, name)) as f:
                fields = dict(line.split() for line in f if len(line.split()) == 2)
        except OSError:
            return False
        return int(fields.get("oom_kill", 0)) > 0


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, options) of every cgroup mount."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype, _source, options = (right.split() + ["", ""])[:3]
                if fstype in ("cgroup", "cgroup2"):
                    out.append((left.split()[4], fstype, set(options.split(","))))
    except OSError:
        pass
    return out


def _own_v1_paths() -> dict[str, str]:
    """controller -> this process's cgroup path in that v1 hierarchy."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(","):
                    if c:
                        paths[c] = path
    except OSError:
        pass
    return paths


def _v2_parent(point: str) -> str | None:
    """``<mount>/rlhf-sandbox`` with memory and pids delegated to its children, or None."""
    try:
        with open(os.path.join(point, "cgroup.controllers")) as f:
            available = set(f.read().split())
        wanted = [c for c in ("memory", "pids") if c in available]
        if not wanted:
            return None
        enable = " ".join("+" + c for c in wanted)
        with open(os.path.join(point, "cgroup.subtree_control"), "w") as f:
            f.write(enable)
        parent = os.path.join(point, V2_PARENT)
        os.makedirs(parent, exist_ok=True)
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
            f.write(enable)
        return parent
    except OSError:
        return None


def discover() -> dict[str, tuple[str, str] | None]:
    """Where each controller (memory, pids) can be used: ("v2" | "v1", parent directory)."""
    global _discovered
    if _discovered is not None:
        return _discovered
    found: dict[str, tuple[str, str] | None] = {"memory": None, "pids": None}
    if os.geteuid() == 0 and os.access("/proc/self/mountinfo", os.R_OK):
        own = _own_v1_paths()
        for point, fstype, options in _mounts():
            if fstype == "cgroup2":
                parent = _v2_parent(point)
                if parent is not None:
                    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                        enabled = set(f.read().split())
                    for c in ("memory", "pids"):
                        if c in enabled and found[c] is None:
                            found[c] = ("v2", parent)
            else:
                for c in ("memory", "pids"):
                    if c in options and found[c] is None and c in own:
                        parent = os.path.join(point, own[c].lstrip("/"))
                        if os.access(parent, os.W_OK):
                            found[c] = ("v1", parent)
    _discovered = found
    for parent in {where[1] for where in found.values() if where is not None}:
        remove_stale(parent)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def remove_stale(parent: str) -> list[str]:
    """Remove the per-call cgroups under ``parent`` whose host process no longer runs (a host
    killed mid-call); what is still in them is killed first. Returns the removed paths."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(_PREFIX):].partition("-")[0] if name.startswith(_PREFIX) else ""
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
            continue
        path = os.path.join(parent, name)
        remove(Cgroup(dirs=[path]), timeout_s=0.5)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def create(memory_bytes: int, max_tasks: int) -> Cgroup:
    """A fresh cgroup (one per hierarchy) holding the limits; best effort, never raises."""
    group = Cgroup()
    name = f"{_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
    made: dict[str, str] = {}
    for controller, where in discover().items():
        if where is None:
            continue
        version, parent = where
        path = made.get(parent) or os.path.join(parent, name)
        try:
            if parent not in made:
                os.mkdir(path, 0o755)
                made[parent] = path
                group.dirs.append(path)
                group.procs.append(os.path.join(path, "cgroup.procs"))
            if controller == "memory":
                settings = ({"memory.max": memory_bytes, "memory.swap.max": 0} if version == "v2"
                            else {"memory.limit_in_bytes": memory_bytes})
                group.memory_dir, group.memory_version = path, version
            else:
                settings = {"pids.max": max_tasks}
            for key, value in settings.items():
                try:
                    with open(os.path.join(path, key), "w") as f:
                        f.write(str(value))
                except OSError:
                    if key == "memory.swap.max":  # no swap accounting: nothing to limit
                        continue
                    raise
            group.layers.append(f"cgroup_{controller}")
        except OSError:
            continue
    return group


def join(group: Cgroup, pid: int) -> list[str]:
    """Move ``pid`` into the cgroup; the layers that hold (none when the move failed)."""
    for path in group.procs:
        try:
            with open(path, "w") as f:
                f.write(str(pid))
        except OSError:
            return []
    return list(group.layers)


def remove(group: Cgroup, timeout_s: float = 2.0) -> None:
    """Kill what is left in the cgroup and delete it."""
    for path in reversed(group.dirs):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                _kill_members(path)
                time.sleep(0.005)


def _kill_members(path: str) -> None:
    kill_file = os.path.join(path, "cgroup.kill")
    if os.path.exists(kill_file):
        try:
            with open(kill_file, "w") as f:
                f.write("1")
            return
        except OSError:
            pass
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            pids = [int(p) for p in f.read().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
