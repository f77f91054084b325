"""The GPU check kit (tools/gpu_check.sh, tools/gpu_kit/) on a CPU, offline:

* the dry run builds this checkout's wheel, lists the rest of the bundle and the transfer size,
  prints the device plan with every check's commands, and runs checks at toy sizes through the
  device half's driver: their processes, results, comparisons and the JSON, table and log;
* the device half installs a bundle without network, runs this checkout, and without a GPU stops
  after the environment check, still writing its report;
* every check's rlhf commands parse, at the GPU's sizes and the dry run's;
* the driver reports a check that passes, one that outlives its timeout, one that dies without a
  result, skips the rest after a required check fails and what the budget leaves no room for;
* the bundle refuses to exceed the transfer limit and keeps one version of each package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tools.gpu_kit import bundle
from tools.gpu_kit.__main__ import expected_wall
from tools.gpu_kit.checks import CHECKS, Check
from tools.gpu_kit.report import compact
from tools.gpu_kit.runner import Runner
from tools.gpu_kit.runs import Context

DRY_RUN_CHECKS = ["environment", "sft_packing", "pytest_gpu"]  # one of each kind: a probe, rlhf commands, pytest


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dry-run")
    env = {**os.environ, "PYTHON": sys.executable, "RLHF_LOAD_PLUGINS": "", "OUT": ""}
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run", "--no-download", "--bundle-dir", str(root / "bundle"),
         "--out", str(root / "out"), "--only", ",".join(DRY_RUN_CHECKS)],
        capture_output=True, text=True, env=env, timeout=400)
    return root, result


@pytest.mark.run
def test_the_dry_run_bundles_plans_and_runs_checks_offline(dry_run):
    root, result = dry_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    out = result.stdout
    wheels = sorted(p.name for p in (root / "bundle").glob("*.whl"))
    assert len(wheels) == 1 and wheels[0].startswith("rlhf_core-"), wheels  # built offline; nothing downloaded
    for pin in bundle.PINS:
        assert f"{pin.name}=={pin.version}" in out
    assert out.count("not downloaded (--no-download)") == len(bundle.PINS)
    assert "of the 64.0 MiB transfer limit" in out
    assert "plan (GPU sizes, bf16)" in out and "expected on an H100/H200" in out
    for check in DRY_RUN_CHECKS:
        assert f"  {check}" in out
    assert "rlhf sft --model" in out and "--packing" in out  # the plan shows the commands

    report = json.loads((root / "out" / "gpu_check.json").read_text())
    assert report["mode"] == "cpu dry run"
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == [check.name for check in CHECKS if check.name in DRY_RUN_CHECKS]  # the plan's order
    assert {c["status"] for c in checks.values()} == {"pass"}, {n: c["criteria"] for n, c in checks.items()}
    assert report["environment"]["torch"] and report["summary"]["pass"] == 3

    packing = {c["name"]: c for c in checks["sft_packing"]["criteria"]}
    assert {"step 1 loss", "step 1 grad norm", "step 2 loss"} <= set(packing)
    assert all(packing[name]["ok"] is True for name in ("step 1 loss", "step 1 grad norm", "step 2 loss"))
    assert checks["sft_packing"]["figures"]["step 1 loss diff"] < 1e-4  # float32 on a CPU
    assert checks["sft_packing"]["figures"]["packed units/s"] > 0

    tests = checks["pytest_gpu"]["tests"]
    assert tests and all("test_cuda_numerics.py::" in t["name"] and "[cuda-" in t["name"] for t in tests)
    assert {t["outcome"] for t in tests} == {"skipped"}  # no CUDA here: exactly what CI sees

    table = (root / "out" / "gpu_check.md").read_text()
    for check in DRY_RUN_CHECKS:
        assert f"| {check} | pass |" in table
    assert "| gpu test | outcome |" in table and "vLLM and flash-attn" in table
    log = (root / "out" / "gpu_check.log").read_text()
    assert "===== sft_packing =====" in log and "rlhf sft" in log


@pytest.mark.run
def test_the_device_half_installs_the_bundle_and_stops_without_a_gpu(dry_run):
    root, _ = dry_run  # its bundle: this checkout's wheel alone, which any Python installs
    env = {**os.environ, "PYTHON": sys.executable, "RLHF_LOAD_PLUGINS": "", "OUT": str(root / "device-out"),
           "GPU_CHECK_WORK": str(root / "device-work"), "GPU_CHECK_SITE": str(root / "device-site"),
           "CUDA_VISIBLE_DEVICES": ""}
    script = str(ROOT / "tools" / "gpu_check.sh")
    empty = subprocess.run(["bash", script, "--device", "--bundle-dir", str(root / "nothing")], capture_output=True,
                           text=True, env=env, timeout=60)
    assert empty.returncode == 2 and "no wheels in" in empty.stderr
    result = subprocess.run(["bash", script, "--device", "--bundle-dir", str(root / "bundle"), "--only",
                             "environment,ppo_critic"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # no CUDA: the required check fails
    assert (root / "device-site" / "rlhf").is_dir()  # installed without network
    report = json.loads((root / "device-out" / "gpu_check.json").read_text())
    assert report["mode"] == "gpu" and report["install_s"] is not None
    environment, ppo = report["checks"]
    criteria = {c["name"]: c["ok"] for c in environment["criteria"]}
    assert criteria["a CUDA GPU is visible"] is False and criteria["rlhf imports from this checkout"] is True
    assert ppo["status"] == "skip" and "required check environment" in ppo["skipped"]
    assert result.stdout.rstrip().splitlines()[-1].startswith("gpu kit: 1 fail, 1 skip")


@pytest.mark.unit
@pytest.mark.parametrize("cpu", [False, True], ids=["gpu-sizes", "dry-run-sizes"])
def test_every_check_command_parses(plugins, tmp_path, cpu):
    import click

    from rlhf.cli.main import make_cli
    from rlhf.cli.state import CliState

    cli = make_cli(plugins)
    root = click.Context(cli, info_name="rlhf", obj=CliState(plugins, verbose=False))
    commands = 0
    for check in CHECKS:
        if check.runs is None:
            continue
        for run in check.runs(Context(repo=ROOT, work=tmp_path / check.name, cpu=cpu)):
            command = cli.get_command(root, run.argv[0])
            command.make_context(run.argv[0], list(run.argv[1:]), parent=root)  # a renamed or mistyped flag raises
            assert run.out.is_relative_to(tmp_path)
            commands += 1
    assert commands >= 10


FAKE = {  # what each fake check's process does
    "passes": "write({'figures': {'s/step': 0.5}, 'criteria': [{'name': 'fine', 'ok': True, 'detail': ''}]})",
    "hangs": "print('still going', flush=True); time.sleep(60)",
    "dies": "print('boom'); sys.exit(3)",
    "fails": "write({'criteria': [{'name': 'loss equal', 'ok': False, 'detail': '1 vs 2'}]})",
    "after": "write({})",
}


class FakeRunner(Runner):
    def command(self, check, work):
        script = textwrap.dedent(f"""
            import json, sys, time
            def write(result):
                open({str(work / 'result.json')!r}, 'w').write(json.dumps(result))
            {FAKE[check.name]}
        """)
        return [sys.executable, "-c", script]


def fake(name, *, timeout_s=30, required=False, alone=False):
    return Check(name, f"the {name} check", timeout_s=timeout_s, expected_s=1, required=required, alone=alone)


def fake_run(tmp_path, checks, budget_s=60.0, jobs=2):
    runner = FakeRunner(repo=ROOT, work=tmp_path / "work", out=tmp_path / "out", cpu=False, budget_s=budget_s,
                        jobs=jobs, min_start_s=1, say=lambda line: None)
    report = runner.run(checks)
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["summary"] == report["summary"]
    return {c["name"]: c for c in report["checks"]}, report


@pytest.mark.unit
def test_the_driver_reports_passes_timeouts_deaths_and_failures(tmp_path):
    results, report = fake_run(tmp_path, [fake("passes", alone=True), fake("hangs", timeout_s=2), fake("dies"),
                                          fake("fails")])
    assert [results[n]["status"] for n in ("passes", "hangs", "dies", "fails")] == ["pass", "timeout", "fail", "fail"]
    assert results["passes"]["figures"] == {"s/step": 0.5}
    assert results["hangs"]["wall_s"] < 15 and "still going" in results["hangs"]["log_tail"]
    assert "boom" in results["dies"]["log_tail"] and results["dies"]["criteria"][0]["ok"] is False
    assert results["fails"]["criteria"][0]["detail"] == "1 vs 2"
    assert report["summary"] == {"pass": 1, "fail": 2, "timeout": 1, "skip": 0}
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| hangs | timeout |" in table and "FAIL: loss equal (1 vs 2)" in table
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "===== dies =====" in log and "boom" in log
    last = compact(report)  # what the end of the device call's output shows
    assert last[0].startswith("pass    passes") and "s/step 0.5" in last[0]
    assert "FAIL: loss equal (1 vs 2)" in last[3] and last[-1].startswith("gpu kit: 1 pass, 2 fail, 1 timeout")


@pytest.mark.unit
def test_a_second_run_in_the_same_work_folder_starts_each_check_afresh(tmp_path):
    """A warm device keeps the last call's work folder: its run directories must not be found again
    (rlhf refuses an --out that already holds a run)."""
    stale = tmp_path / "work" / "passes" / "run" / "metrics.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}\n")
    results, _ = fake_run(tmp_path, [fake("passes")])
    assert results["passes"]["status"] == "pass" and not stale.exists()


@pytest.mark.unit
def test_a_failed_required_check_or_a_spent_budget_leaves_the_rest_unstarted(tmp_path):
    results, _ = fake_run(tmp_path / "a", [fake("fails", required=True), fake("passes")])
    assert results["passes"]["status"] == "skip" and "the required check fails did not pass" in results["passes"]["skipped"]

    results, _ = fake_run(tmp_path / "b", [fake("hangs", timeout_s=60, alone=True), fake("after")], budget_s=3)
    assert results["hangs"]["status"] == "timeout" and results["hangs"]["wall_s"] < 15  # given the budget, not 60 s
    assert results["after"]["status"] == "skip" and "budget" in results["after"]["skipped"]


@pytest.mark.unit
def test_the_plan_estimate_packs_checks_beside_each_other():
    checks = [fake("passes", required=True), Check("a", "", 10, 30), Check("b", "", 10, 20), Check("c", "", 10, 20)]
    assert expected_wall(checks, jobs=2) == 1 + 40  # a beside b, then c after b
    assert expected_wall(checks, jobs=4) == 1 + 30


@pytest.mark.unit
def test_the_bundle_stays_under_the_transfer_limit_and_keeps_one_version(tmp_path):
    with pytest.raises(SystemExit, match="over the 64.0 MiB the device call carries"):
        bundle.check_size(60 * 2**20, 5 * 2**20)
    bundle.check_size(50 * 2**20, 5 * 2**20)
    assert len({pin.name for pin in bundle.PINS}) == len(bundle.PINS)
    for name in ("pydantic-2.11.0-py3-none-any.whl", "pydantic-2.14.4-py3-none-any.whl",
                 "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    pin = next(p for p in bundle.PINS if p.name == "pydantic")
    kept = bundle.pinned_wheel(tmp_path, pin)
    assert kept.name == "pydantic-2.14.4-py3-none-any.whl"
    assert [p.name for p in bundle.drop_other_versions(tmp_path, "pydantic", kept)] == ["pydantic-2.11.0-py3-none-any.whl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pydantic-2.14.4-py3-none-any.whl",
                                                          "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl"]
    assert bundle.tree_size(ROOT) < bundle.TRANSFER_LIMIT / 2
