"""benchmarks/harness.py's judgement: a ratio only when both sides counted the same work, the
floor always the denominator, medians and per-round spreads from the workers' step times."""

import argparse
import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_SPEC = importlib.util.spec_from_file_location(
    "bench_harness", Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py")
harness = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(harness)


def run(cpu, work, peak=100.0):
    return {"cpu": cpu, "wall": cpu, "work": work, "peak_rss_mb": peak, "foreign_imports": [], "kernels": None}


STEP = {"samples": 32.0, "generated_tokens": 2048.0, "trained_samples": 32.0, "trained_tokens": 2048.0}


def test_equal_work_ignores_the_dropped_first_step_and_accepts_equal_counts():
    a = run([9.0, 1.0, 1.0], [{"samples": 1.0}, STEP, STEP])
    b = run([9.0, 2.0, 2.0], [{"samples": 7.0}, dict(STEP), dict(STEP)])
    assert harness.equal_work(a, b) is None


def test_equal_work_names_the_first_difference():
    skipped = dict(STEP, trained_samples=24.0, trained_tokens=1536.0)  # a side that skipped tied groups
    a = run([1.0, 1.0, 1.0], [STEP, STEP, STEP])
    b = run([1.0, 1.0, 1.0], [STEP, STEP, skipped])
    assert harness.equal_work(a, b) == "step 3: trained_samples 32 against 24"


def test_equal_work_refuses_a_count_only_one_side_made_and_unequal_step_counts():
    a = run([1.0, 1.0], [STEP, STEP])
    b = run([1.0, 1.0], [STEP, {k: v for k, v in STEP.items() if k != "generated_tokens"}])
    assert "generated_tokens counted by one side only" in harness.equal_work(a, b)
    assert harness.equal_work(a, run([1.0, 1.0, 1.0], [STEP] * 3)) == "1 against 2 measured steps"


def test_summary_medians_over_measured_steps_and_round_spread():
    runs = [run([5.0, 1.0, 3.0], [STEP] * 3, peak=120.0), run([5.0, 2.0, 4.0], [STEP] * 3, peak=110.0)]
    s = harness.summary(runs)
    assert s["cpu"] == 2.5  # median of 1, 3, 2, 4 (first steps dropped)
    assert s["cpu_rounds"] == [2.0, 3.0]
    assert s["peak_rss_mb"] == 120.0 and s["steps"] == 4


def test_ratio_pairs_put_the_floor_below_and_later_sides_over_earlier():
    assert harness.ratio_pairs(["rlhf", "trl", "floor"]) == [("trl", "rlhf"), ("rlhf", "floor"), ("trl", "floor")]
    assert harness.ratio_pairs(["rlhf:mmap=1", "rlhf:mmap=2"]) == [("rlhf:mmap=2", "rlhf:mmap=1")]


def test_ratio_line_gives_the_median_ratio_and_the_per_round_range():
    num = [run([0.0, 3.0], [STEP] * 2, peak=200.0), run([0.0, 2.0], [STEP] * 2, peak=200.0)]
    den = [run([0.0, 1.0], [STEP] * 2, peak=100.0), run([0.0, 2.0], [STEP] * 2, peak=100.0)]
    line = harness.ratio_line("trl/rlhf", harness.summary(num), harness.summary(den), num, den)
    assert line == "trl/rlhf 1.67 (1.00-3.00), peak RSS 2.00"


def test_side_variants_parse_and_unknown_settings_stop():
    assert harness.parse_side("rlhf:mmap=33554432,cpu-linear=onednn") == (
        "rlhf", {"mmap": "33554432", "cpu-linear": "onednn"})
    with pytest.raises(SystemExit):
        harness.parse_side("rlhf:threads=2")
    with pytest.raises(SystemExit):
        harness.parse_side("verl")
    # --sides: a comma starts a side only before a side's name; a side keeps all its settings
    assert harness.split_sides("rlhf,rlhf:cpu-linear=auto,checkout=/old,trl,floor:mmap=1,cpu-linear=torch") == [
        "rlhf", "rlhf:cpu-linear=auto,checkout=/old", "trl", "floor:mmap=1,cpu-linear=torch"]


def test_a_checkout_variant_puts_that_checkout_first_on_the_path(tmp_path):
    (tmp_path / "rlhf").mkdir()
    assert harness.parse_side(f"rlhf:checkout={tmp_path}") == ("rlhf", {"checkout": str(tmp_path)})
    args = argparse.Namespace(mmap_threshold="default", kernel_caches="default", work_dir=tmp_path)
    other = harness.side_env(args, f"rlhf:checkout={tmp_path}")["PYTHONPATH"].split(os.pathsep)
    assert other[0] == str(tmp_path.resolve())
    assert harness.side_env(args, "floor")["PYTHONPATH"].split(os.pathsep)[0] == str(harness.ROOT)
    with pytest.raises(SystemExit):
        harness.parse_side(f"trl:checkout={tmp_path}")  # TRL never imports rlhf
    with pytest.raises(SystemExit):
        harness.parse_side(f"rlhf:checkout={tmp_path / 'missing'}")


def test_every_side_gets_the_bound_on_compiled_kernels_rlhf_sets(tmp_path, monkeypatch):
    (tmp_path / "kernel_caches.json").write_text('{"capacity": 64}')
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")  # the caller's own: replaced, as on every side
    args = argparse.Namespace(mmap_threshold="default", kernel_caches="rlhf", work_dir=tmp_path)
    for side in ("rlhf", "trl", "floor"):
        env = harness.side_env(args, side)
        assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == env["LRU_CACHE_CAPACITY"] == "64"
    args.kernel_caches = "default"
    assert "LRU_CACHE_CAPACITY" not in harness.side_env(args, "trl")
    args.kernel_caches = "256"
    assert harness.side_env(args, "trl")["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"


def test_memory_overheads_are_peaks_above_the_floor_sides_training_state():
    stats = {"rlhf": {"peak_rss_mb": 1300.0}, "trl": {"peak_rss_mb": 2000.0},
             "floor": {"peak_rss_mb": 1500.0, "state_floor_mb": 1000.0}}
    memory = harness.memory_overheads(stats)
    assert memory["state_floor_mb"] == 1000.0
    assert memory["above_floor_mb"] == {"rlhf": 300.0, "trl": 1000.0, "floor": 500.0}
    assert memory["rlhf/trl"] == pytest.approx(0.3)
    assert harness.memory_overheads({"rlhf": {"peak_rss_mb": 1.0}}) == {}
    floor_runs = [dict(run([0.0, 1.0], [STEP] * 2), state_floor_mb=x) for x in (990.0, 1010.0, 1000.0)]
    assert harness.summary(floor_runs)["state_floor_mb"] == 1000.0


def test_the_table_shows_the_floor_and_each_side_above_it():
    stats = {"rlhf": harness.summary([run([0.0, 1.0], [STEP] * 2, peak=1300.0)]),
             "trl": harness.summary([run([0.0, 2.0], [STEP] * 2, peak=2000.0)]),
             "floor": harness.summary([dict(run([0.0, 1.5], [STEP] * 2, peak=1500.0), state_floor_mb=1000.0)])}
    report = {"jobs": {"grpo-vocab152k": {"steps": 2, "rounds": 1, "sides": stats, "ratios": {},
                                          "memory": harness.memory_overheads(stats)}}}
    table = harness.markdown(report)
    assert "| state floor MB | above it MB (rlhf / trl) | overhead rlhf/trl |" in table
    assert table.splitlines()[-1].endswith("| 1,000 | 300 / 1,000 | 0.30 |")


def test_the_dtype_reaches_every_side_s_worker_command(tmp_path):
    args = argparse.Namespace(trl_python="/trl/python", rlhf_python="/rlhf/python", work_dir=tmp_path, cpu_linear="torch",
                              set="", dtype="bf16")
    for spec, python in (("rlhf", "/rlhf/python"), ("trl", "/trl/python"), ("floor", "/rlhf/python")):
        command = harness.worker_command(args, "dpo", spec, 3, tmp_path / "out.json")
        assert command[0] == python and command[command.index("--side") + 1] == spec
        assert command[command.index("--dtype") + 1] == "bf16"
        assert command[command.index("--cpu-linear") + 1] == "torch"
    command = harness.worker_command(args, "dpo", "rlhf:cpu-linear=onednn", 3, tmp_path / "out.json")
    assert command[command.index("--cpu-linear") + 1] == "onednn"


def test_the_harness_offers_every_job_the_worker_runs():
    import sys

    sys.path.insert(0, str(harness.HERE))
    try:
        spec = importlib.util.spec_from_file_location("bench_worker_jobs", harness.WORKER)
        worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(worker)
    finally:
        sys.path.remove(str(harness.HERE))
    assert set(harness.JOBS) == set(worker.JOBS)
    assert worker.JOBS["dpo-packing"] == dict(kind="dpo", model="small", steps=5, packing=True)
