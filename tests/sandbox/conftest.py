"""Process bookkeeping for the sandbox tests: what a sandbox left behind, read from /proc."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest

needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def processes_with_marker(marker: str) -> list[int]:
    """Processes (zombies included) whose environment or command line carries ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            if marker.encode() in _read(f"/proc/{name}/environ") + _read(f"/proc/{name}/cmdline"):
                found.append(int(name))
    return found


def sandbox_children() -> list[int]:
    """Sandbox supervisors that are still children of this test process (alive or unreaped)."""
    found = []
    for name in os.listdir("/proc"):
        stat = _read(f"/proc/{name}/stat") if name.isdigit() else b""
        if stat and int(stat[stat.rindex(b")") + 2:].split()[1]) == os.getpid():
            if b"_sandbox_child" in _read(f"/proc/{name}/cmdline") or b"(python" in stat:
                found.append(int(name))
    return found


@pytest.fixture
def marker() -> Iterator[str]:
    """A token to pass as ``env={"RLHF_TEST_MARKER": marker}``; after the test no process may carry it."""
    token = f"rlhf-marker-{uuid.uuid4().hex}"
    before = set(sandbox_children())  # e.g. a local Ray cluster an earlier test started in this process
    yield token
    assert processes_with_marker(token) == [], "a sandboxed process outlived run_code"
    assert sorted(set(sandbox_children()) - before) == [], "a sandbox supervisor was not reaped"


# --- run data to hide (test_hidden_run_data, test_editable_hooks) ----------------------------------


@pytest.fixture
def registered():
    """`rlhf.sandbox.hide_by_default`, cleared after the test."""
    from rlhf import sandbox

    yield sandbox.hide_by_default
    sandbox.hide_by_default(())


@pytest.fixture
def project():
    """A project outside /tmp (the sandbox's /tmp is its own already) and outside any home."""
    import json
    import shutil
    from pathlib import Path

    if not os.access("/var/lib", os.W_OK):
        pytest.skip("needs a writable folder outside /tmp and home directories (/var/lib as root)")
    tmp_path = Path("/var/lib") / f"rlhf-test-{uuid.uuid4().hex[:8]}"
    tmp_path.mkdir()
    answer = f"label-{uuid.uuid4().hex}"
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    data = root / "data" / "train.jsonl"
    data.write_text(json.dumps({"prompt": "What is the secret?", "answer": answer}) + "\n")
    elsewhere = tmp_path / "elsewhere.jsonl"  # a data file outside any hidden directory
    elsewhere.write_text(json.dumps({"answer": answer}) + "\n")
    for path in (data, elsewhere):
        path.chmod(0o644)  # world-readable, as data files are
    for folder in (tmp_path, root, root / "data"):
        folder.chmod(0o755)
    yield {"root": root, "data": data, "elsewhere": elsewhere, "answer": answer}
    shutil.rmtree(tmp_path)
