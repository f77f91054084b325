"""``pytest -m gpu`` as a check: every test marked ``gpu``, each reported with its outcome and the
figures it records (``record_property``: the largest differences the CUDA comparisons measured).

On the GPU it runs the whole suite's ``gpu`` tests; the dry run collects only the CUDA numerics
module (every ``gpu`` test there is skipped without CUDA, which is what CI sees).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from tools.gpu_kit.runs import Context
from tools.gpu_kit.verdicts import Verdict

CUDA_NUMERICS = "tests/runtime/test_cuda_numerics.py"


def read_junit(path: Path) -> list[dict[str, Any]]:
    """One dict per test case of a junit XML file: name, outcome, message, time_s, figures."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                text = (found.get("message") or found.text or "").strip()
                message = text.splitlines()[0][:200] if text else ""
                break
        figures = {p.get("name"): p.get("value") for p in case.iter("property")}
        module = case.get("classname", "").replace(".", "/")
        cases.append({"name": f"{module}.py::{case.get('name')}" if module else case.get("name"),
                      "outcome": outcome, "message": message, "time_s": float(case.get("time") or 0),
                      "figures": figures})
    return cases


def pytest_gpu(ctx: Context) -> Verdict:
    verdict = Verdict()
    junit = ctx.work / "junit.xml"
    where = [CUDA_NUMERICS] if ctx.cpu else ["tests"]
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
               f"--junitxml={junit}", *where]
    print(f"[gpu kit] {' '.join(command)}", flush=True)
    result = subprocess.run(command, cwd=ctx.repo, env=os.environ.copy())
    verdict.figures["pytest exit"] = result.returncode
    if not junit.is_file():
        verdict.judge("pytest wrote its report", False, f"exit {result.returncode}, no {junit.name}: see the log")
        return verdict
    verdict.tests = read_junit(junit)
    counts = {kind: sum(t["outcome"] == kind for t in verdict.tests) for kind in ("passed", "failed", "error", "skipped")}
    verdict.figures.update(counts)
    bad = [t["name"] for t in verdict.tests if t["outcome"] in ("failed", "error")]
    verdict.judge("no gpu test failed", not bad and result.returncode == 0,
                  ", ".join(bad) if bad else f"exit {result.returncode}")
    numerics = [t for t in verdict.tests if CUDA_NUMERICS in t["name"]]
    ran = [t for t in numerics if t["outcome"] != "skipped"]
    if ctx.cpu:
        verdict.judge("the CUDA numerics tests ran", None, f"not judged: {len(numerics)} collected, skipped without CUDA")
    else:
        verdict.judge("the CUDA numerics tests ran", bool(numerics) and len(ran) == len(numerics),
                      f"{len(ran)} of {len(numerics)} ran")
    return verdict
