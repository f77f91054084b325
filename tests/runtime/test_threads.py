"""CPU threads chosen for a shared machine (rlhf/runtime/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf.runtime.threads import SPIN_COUNT, choose_threads, others_load, prepare_openmp


@pytest.mark.parametrize(("load", "expected"), [
    (0.0, 2),   # idle: torch's default, one per core
    (0.4, 2),   # a little background work rounds away
    (0.6, 1),   # one core busy elsewhere: one thread
    (1.4, 1),
    (9.0, 1),   # never fewer than one
])
def test_threads_capped_by_the_cores_others_leave_free(load, expected):
    assert choose_threads(None, 2, cores=2, load=load) == expected


def test_more_free_cores_never_raise_torch_default():
    assert choose_threads(None, 4, cores=16, load=0.0) == 4
    assert choose_threads(None, 8, cores=8, load=3.0) == 5


def test_requested_threads_win_and_unknown_load_keeps_default():
    assert choose_threads(3, 2, cores=2, load=9.0) == 3
    assert choose_threads(None, 2, cores=2, load=None) == 2


def test_spin_count_set_only_when_user_chose_nothing():
    env: dict[str, str] = {}
    prepare_openmp(env)
    assert env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        prepare_openmp(env)
        assert env == chosen


def test_others_load_is_a_nonnegative_figure_on_linux():
    load = others_load(samples=2, interval=0.0)
    if hasattr(os, "getloadavg"):
        assert load is not None and load >= 0.0


def test_rlhf_command_sets_spin_count_before_torch_loads():
    """The command sets it before anything imports torch (OpenMP reads it when torch loads it)."""
    code = ("import os, sys\n"
            "from rlhf.cli import main as m\n"
            "assert 'torch' not in sys.modules\n"
            "try:\n    m.main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == SPIN_COUNT


def test_the_governor_follows_the_load_between_steps(monkeypatch):
    import torch

    from rlhf.runtime import threads

    before = torch.get_num_threads()
    loads = iter([3.0, 3.0, 3.0, 0.0, 0.0, 0.0])
    monkeypatch.setattr(threads, "others_load", lambda **_: next(loads))
    governor = threads.ThreadGovernor(default=2, cores=2, load=0.0)
    try:
        # smoothed (half the old figure, half the new): 1.5, 2.25, 2.6, then 1.3, 0.66, 0.33 busy cores
        assert [governor.adjust() for _ in range(6)] == [1, 1, 1, 1, 1, 2]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_requested_count_turns_the_governor_off():
    import torch

    from rlhf.runtime import threads

    before = torch.get_num_threads()
    try:
        assert threads.set_threads(1) == 1 and threads._governor is None
        threads.adjust_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
