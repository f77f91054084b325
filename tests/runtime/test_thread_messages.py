"""What a run says about its CPU threads (rlhf/runtime/run/threads.py, ``set_threads``): a count the
machine fixed (no ``--threads``) is named with how to choose another; a count the user chose is not
announced."""

from __future__ import annotations

import logging

import pytest
import torch

from rlhf.runtime.run import threads

pytestmark = pytest.mark.unit


@pytest.fixture
def machine_of_four(monkeypatch):
    monkeypatch.delenv("RLHF_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_count_fixed_by_the_machine_is_said_with_how_to_choose(machine_of_four, caplog):
    with caplog.at_level(logging.INFO, logger="rlhf.runtime.run.threads"):
        assert threads.set_threads(None) == 2
    assert "using 2 CPU thread(s), fixed for this machine (--threads N to choose" in caplog.text


def test_a_chosen_count_is_not_announced(machine_of_four, caplog):
    with caplog.at_level(logging.INFO, logger="rlhf.runtime.run.threads"):
        assert threads.set_threads(3) == 3 and torch.get_num_threads() == 3
    assert "fixed for this machine" not in caplog.text
