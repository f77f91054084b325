"""Per-call cgroups left by a host that was killed mid-call are removed by the next process that
uses the sandbox (rlhf/sandbox/_sandbox_cgroup.py `remove_stale`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf.sandbox import _sandbox_cgroup

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_per_call_cgroups_are_removed_and_live_ones_kept(tmp_path):
    """On plain folders (``rmdir`` is what deletes an empty cgroup): a dead host's folders go, this
    process's, a live process's and other names stay."""
    dead = _dead_pid()
    names = [f"rlhf-sandbox-{dead}-0a0b", f"rlhf-sandbox-{os.getpid()}-0c0d", f"rlhf-sandbox-{os.getppid()}-0e0f",
             "rlhf-sandbox-notapid-1", "someone-else"]
    for name in names:
        (tmp_path / name).mkdir()
    removed = _sandbox_cgroup.remove_stale(str(tmp_path))
    assert removed == [str(tmp_path / names[0])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_the_next_discover_removes_a_killed_hosts_cgroup(monkeypatch):
    """A real cgroup (root with a writable hierarchy), named as a killed host's call would be."""
    found = _sandbox_cgroup.discover()
    parents = {where[1] for where in found.values() if where is not None}
    if not parents:
        pytest.skip("no writable cgroup hierarchy here")
    stale = [os.path.join(parent, f"rlhf-sandbox-{_dead_pid()}-feed") for parent in parents]
    for path in stale:
        os.mkdir(path)
    monkeypatch.setattr(_sandbox_cgroup, "_discovered", None)
    _sandbox_cgroup.discover()
    assert not any(os.path.exists(path) for path in stale)
