"""Test-wide settings: nothing touches the network or the home directory.

The environment is set at import, before any test imports ray, deepspeed or transformers.
One temporary folder per session holds DeepSpeed's compiled extensions and Ray's files, so the
~20 s extension build happens once per session, not once per test.
"""

from __future__ import annotations

import os
import tempfile

import pytest

_SESSION_TMP = tempfile.mkdtemp(prefix="rlhf-tests-")
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HOME": os.path.join(_SESSION_TMP, "hf"),
    "DS_ACCELERATOR": "cpu",
    "TORCH_EXTENSIONS_DIR": os.path.join(_SESSION_TMP, "torch_extensions"),
    "RAY_TMPDIR": os.path.join(_SESSION_TMP, "ray"),
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
    # A fixed thread count: runs compared bit for bit within a test must not follow the machine's load
    # (rlhf.runtime.run.threads), and one thread per process keeps a shared 2-core machine fast.
    "RLHF_THREADS": "1",
    "GOMP_SPINCOUNT": "10000",
}.items():
    os.environ.setdefault(_key, _value)
# A developer's own settings must not change what the tests see.
for _key in ("RLHF_LOAD_PLUGINS", "RLHF_DISABLE_PLUGINS", "RLHF_DEBUG", "RAY_ADDRESS"):
    os.environ.pop(_key, None)

pytest_plugins = ["tests.helpers", "pytester"]


# `pytest -n 2` (pyproject.toml adds `--dist loadfile`) sends each test file to one worker, so a
# module-scoped fixture (a training run several tests assert on) is built once; the files of these
# folders go to one worker together, one after another: the Ray tests share one cluster and count
# the machine's Ray actor processes, the sandbox tests look for what a sandbox left in the temp folder.
SERIAL_FOLDERS = ("tests/ray/", "tests/sandbox/")


def scope_of(nodeid: str) -> str:
    """What pytest-xdist hands to one worker at once: a serial folder, else the test's file."""
    return next((f for f in SERIAL_FOLDERS if nodeid.startswith(f)), nodeid.split("::", 1)[0])


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without pytest-xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileOrFolderScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def schedule(self) -> None:
            # hand out scopes in the workers' collection order (costliest tier first, see
            # pytest_collection_modifyitems), not pytest-xdist's most-tests-first
            self.config.option.loadscopereorder = False
            super().schedule()

    return FileOrFolderScheduling(config, log)


# Every test is in exactly one tier (README, "Run the tests"): its file says `pytestmark = pytest.mark.unit`,
# or, where a file mixes tiers, each test says its own. `pytest -m unit` is the quick pass.
TIERS = {
    "unit": "no model is trained or generated from; seconds",
    "run": "trains or generates with a tiny model",
    "cluster": "starts Ray, torchrun or DeepSpeed processes",
}


def tier_error(item: pytest.Item) -> str | None:
    """What is wrong with the test's tier: none, or more than one; None when it has exactly one."""
    tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
    if len(tiers) == 1:
        return None
    choices = ", ".join(f"`{name}` ({meaning})" for name, meaning in TIERS.items())
    return (f"{item.nodeid} is {'in the tiers ' + ' and '.join(tiers) if tiers else 'in no tier'}: mark its file "
            f"(`pytestmark = pytest.mark.unit`), or the test itself where its file mixes tiers, with exactly one of "
            f"{choices}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: a test in no tier is never selected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test without its one tier is a collection error: nothing runs (under pytest-xdist the other tests run, as
    # with any collection error, and the run fails).
    for item in items:
        error = tier_error(item)
        if error:
            config.hook.pytest_collectreport(report=pytest.CollectReport(item.nodeid, "failed", error, []))
    if hasattr(config, "workerinput"):
        # a pytest-xdist worker's collection: the scopes with a cluster test first (the Ray folder, the longest,
        # before them), then those with a run test, the unit files last, so that the files still running when
        # the other worker runs out of work are short ones (by test count, xdist's own order, the one-test files
        # that train for minutes came last)
        rank = {"cluster": 0, "run": 1, "unit": 2}
        order: dict[str, tuple[int, bool]] = {}
        for item in items:
            scope = scope_of(item.nodeid)
            tier = rank[next((m.name for m in item.iter_markers() if m.name in TIERS), "unit")]
            order[scope] = (min(order.get(scope, (2,))[0], tier), scope not in SERIAL_FOLDERS)
        items.sort(key=lambda item: order[scope_of(item.nodeid)])  # stable: a file's tests keep their order
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
