"""CPU threads chosen for a shared machine (rlhf/runtime/run/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf.runtime.run.threads import SPIN_COUNT, choose_threads, others_load, prepare_openmp, split_threads


@pytest.mark.unit
@pytest.mark.parametrize(("load", "expected"), [
    (0.0, 2),   # idle: torch's default, one per core
    (0.4, 2),   # a little background work rounds away
    (0.6, 1),   # one core busy elsewhere: one thread
    (1.4, 1),
    (9.0, 1),   # never fewer than one
])
def test_threads_capped_by_the_cores_others_leave_free(load, expected):
    assert choose_threads(None, 2, cores=2, load=load) == expected


@pytest.mark.unit
def test_more_free_cores_never_raise_torch_default():
    assert choose_threads(None, 4, cores=16, load=0.0) == 4
    assert choose_threads(None, 8, cores=8, load=3.0) == 5


@pytest.mark.unit
def test_requested_threads_win_and_unknown_load_keeps_default():
    assert choose_threads(3, 2, cores=2, load=9.0) == 3
    assert choose_threads(None, 2, cores=2, load=None) == 2


@pytest.mark.unit
def test_spin_count_set_only_when_user_chose_nothing():
    env: dict[str, str] = {}
    prepare_openmp(env)
    assert env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        prepare_openmp(env)
        assert env == chosen


@pytest.mark.unit
def test_others_load_is_a_nonnegative_figure_on_linux():
    load = others_load(samples=2, interval=0.0)
    if hasattr(os, "getloadavg"):
        assert load is not None and load >= 0.0


@pytest.mark.unit
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


@pytest.mark.unit
def test_the_governor_follows_the_load_between_steps(monkeypatch):
    import torch

    from rlhf.runtime.run import threads

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


@pytest.mark.unit
def test_a_requested_count_turns_the_governor_off():
    import torch

    from rlhf.runtime.run import threads

    before = torch.get_num_threads()
    try:
        assert threads.set_threads(1) == 1 and threads._governor is None
        threads.adjust_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# --- the default: fixed by the machine, recorded, reused ----------------------------------------


@pytest.mark.unit
def test_the_default_is_half_the_cores_whatever_the_load(monkeypatch):
    from rlhf.runtime.run import threads

    assert [threads.default_threads(cores, environ={}) for cores in (1, 2, 3, 16)] == [1, 1, 1, 8]
    assert threads.default_threads(16, environ={"OMP_NUM_THREADS": "3"}) == 3
    assert threads.default_threads(4, environ={"OMP_NUM_THREADS": "x"}) == 2

    def no_look(**_):
        raise AssertionError("the default must not look at the load")

    monkeypatch.setattr(threads, "others_load", no_look)
    monkeypatch.delenv("RLHF_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    import torch

    before = torch.get_num_threads()
    try:
        assert threads.set_threads(None) == 2 and torch.get_num_threads() == 2 and threads._governor is None
        threads.adjust_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.unit
def test_auto_follows_the_load_and_says_so(monkeypatch):
    import torch

    from rlhf.runtime.run import threads

    monkeypatch.setattr(threads, "others_load", lambda **_: 3.0)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert threads.set_threads("auto") == "auto" and torch.get_num_threads() == 1
        assert threads._governor is not None
        monkeypatch.setattr(threads, "others_load", lambda **_: 0.0)
        threads.adjust_threads()  # smoothed: 1.5 busy cores of 4 leave 2.5 free: 3 threads
        assert torch.get_num_threads() == 3
    finally:
        threads._governor = None
        torch.set_num_threads(before)


@pytest.mark.unit
@pytest.mark.parametrize(("given", "environ", "expected"), [
    (None, {}, None), (3, {}, 3), ("3", {}, 3), ("AUTO", {}, "auto"), (None, {"RLHF_THREADS": "2"}, 2),
    (None, {"RLHF_THREADS": "auto"}, "auto"), (4, {"RLHF_THREADS": "2"}, 4)])
def test_requested_threads(given, environ, expected):
    from rlhf.runtime.run.threads import requested_threads

    assert requested_threads(given, environ) == expected


@pytest.mark.unit
@pytest.mark.parametrize(("given", "environ"), [(0, {}), ("many", {}), (None, {"RLHF_THREADS": "-1"}), (True, {})])
def test_a_bad_thread_count_is_a_config_error(given, environ):
    from rlhf.core.errors import ConfigError
    from rlhf.runtime.run.threads import requested_threads

    with pytest.raises(ConfigError, match="at least 1, or auto"):
        requested_threads(given, environ)


def _train(tiny_model_dir, task, out, plugins, *extra):
    from tests.helpers import run_cli

    return run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                             "--label-key", "answer", "--reward", str(task / "rewards.py"), "--n-samples", "4",
                             "--prompts-per-step", "2", "--max-new-tokens", "6", "--out", str(out), "--no-progress",
                             *extra])


@pytest.mark.run
def test_the_same_command_gives_the_same_bits_whatever_the_load(tiny_model_dir, task, tmp_path, plugins,
                                                                monkeypatch):
    """No --threads, an idle machine then a busy one: the same count, recorded, and the same weights."""
    import torch
    import yaml

    from rlhf.runtime.run import threads
    from tests.helpers import final_weights

    monkeypatch.delenv("RLHF_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    before = torch.get_num_threads()
    try:
        runs = []
        for load in (0.0, 3.5):
            monkeypatch.setattr(threads, "others_load", lambda load=load, **_: load)
            out = tmp_path / f"load{load}"
            result = _train(tiny_model_dir, task, out, plugins, "--steps", "2")
            assert result.exit_code == 0, result.output
            assert yaml.safe_load((out / "config.yaml").read_text())["threads"] == 2
            runs.append(final_weights(out))
        assert runs[0].keys() == runs[1].keys()
        assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    finally:
        torch.set_num_threads(before)


@pytest.mark.run
def test_a_resume_reuses_the_runs_count(tiny_model_dir, task, tmp_path, plugins, monkeypatch):
    """The run began with 2 threads; resumed where the default would be 3, it keeps 2 (and says
    nothing changed); --threads still wins."""
    import torch
    import yaml

    from rlhf.runtime.run import threads

    monkeypatch.delenv("RLHF_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "run"
    used = []
    real = threads.set_threads
    monkeypatch.setattr(threads, "set_threads", lambda requested: used.append(real(requested)) or used[-1])
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "usable_cores", lambda: 4)
        assert _train(tiny_model_dir, task, out, plugins, "--steps", "1", "--save-every", "1").exit_code == 0
        monkeypatch.setattr(threads, "usable_cores", lambda: 6)
        result = _train(tiny_model_dir, task, out, plugins, "--steps", "2", "--resume", "--resume-override", "steps")
        assert result.exit_code == 0, result.output
        assert used == [2, 2] and "threads changed" not in result.output
        assert yaml.safe_load((out / "config.yaml").read_text())["threads"] == 2
        result = _train(tiny_model_dir, task, out, plugins, "--steps", "3", "--resume", "--resume-override", "steps",
                        "--threads", "auto")
        assert result.exit_code == 0, result.output
        assert used[-1] == "auto" and yaml.safe_load((out / "config.yaml").read_text())["threads"] == "auto"
    finally:
        threads._governor = None
        torch.set_num_threads(before)


@pytest.mark.unit
def test_threads_zero_is_a_usage_error(tiny_model_dir, task, tmp_path, plugins):
    result = _train(tiny_model_dir, task, tmp_path / "run", plugins, "--threads", "0")
    assert result.exit_code == 2 and "at least 1, or auto" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.unit
@pytest.mark.parametrize("total, staleness, expected", [(1, 0, (1, 1)), (4, 0, (4, 4)), (1, 2, (1, 1)),
                                                         (2, 1, (1, 1)), (3, 1, (1, 2)), (8, 2, (4, 4))])
def test_async_splits_the_count_only_where_producer_and_trainer_overlap(total, staleness, expected):
    assert split_threads(total, staleness) == expected
