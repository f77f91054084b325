"""The device half's driver: every check in a process of its own, with a timeout, inside one budget.

Checks start in the plan's order. A check marked ``alone`` (its figures are timings) runs with
nothing beside it; the others run up to ``jobs`` at a time (one GPU holds them all: they are
small, and mostly wait on kernel launches and Python). A check that would start with less than
`MIN_START_S` of the budget left is not started; a running one is given what is left, at most its
own timeout, and killed (its whole process group) when that runs out. A ``required`` check that
fails leaves the rest unstarted. Whatever happens, the JSON file, the table and the log are written.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.gpu_kit import report
from tools.gpu_kit.checks import Check
from tools.gpu_kit.report import figures_cell
from tools.gpu_kit.verdicts import Verdict

MIN_START_S = 15
CPU_TIMEOUT_S = 240  # the dry run's toy sizes on a shared CPU: one generous limit for every check
LOG_TAIL_LINES = 40


@dataclass
class Running:
    check: Check
    process: subprocess.Popen
    started: float
    timeout_s: float
    work: Path
    log: Any  # the open log file


@dataclass
class Runner:
    repo: Path
    work: Path
    out: Path
    cpu: bool
    budget_s: float
    jobs: int
    install_s: float | None = None  # the device half's install of the bundle, before the checks
    min_start_s: float = MIN_START_S
    python: str = sys.executable
    say: Callable[[str], None] = print
    lines: list[str] = field(default_factory=list)

    def note(self, line: str) -> None:
        self.lines.append(line)
        self.say(line)

    def environment(self, alone: bool, work: Path) -> dict[str, str]:
        """A check's environment: offline, its own caches in its ``work`` folder, no third-party plugins."""
        env = os.environ.copy()
        env["PYTHONPATH"] = os.pathsep.join([str(self.repo), *filter(None, [env.get("PYTHONPATH")])])
        env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "HF_HOME": str(work / "hf"), "TORCH_EXTENSIONS_DIR": str(self.work / "torch_extensions"),
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
                    "RLHF_LOAD_PLUGINS": ""})
        if self.cpu:
            env.update({"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "RLHF_THREADS": "1"})
        elif not alone:  # checks beside each other share the cores
            env["RLHF_THREADS"] = str(max(1, (os.cpu_count() or 4) // self.jobs))
        return env

    def command(self, check: Check, work: Path) -> list[str]:
        """The process that runs ``check`` and writes ``work/result.json``."""
        return [self.python, "-m", "tools.gpu_kit", "check", check.name, "--repo", str(self.repo), "--work", str(work),
                *(["--cpu"] if self.cpu else [])]

    def start(self, check: Check, deadline: float) -> Running | None:
        left = deadline - time.monotonic()
        if left < self.min_start_s:
            return None
        work = self.work / check.name
        shutil.rmtree(work, ignore_errors=True)  # a second call on a warm machine must not find the last runs
        work.mkdir(parents=True)
        log = open(work / "log.txt", "w")
        process = subprocess.Popen(self.command(check, work), cwd=self.repo, env=self.environment(check.alone, work),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        timeout = min(max(check.timeout_s, CPU_TIMEOUT_S) if self.cpu else check.timeout_s, left)
        self.note(f"[gpu kit] start {check.name} (timeout {timeout:.0f} s)")
        return Running(check, process, time.monotonic(), timeout, work, log)

    def finish(self, running: Running, timed_out: bool) -> dict[str, Any]:
        if timed_out:
            stop(running.process)
        running.log.close()
        wall = time.monotonic() - running.started
        result_file = running.work / "result.json"
        if result_file.is_file():
            verdict = Verdict.from_dict(json.loads(result_file.read_text()))
            status = verdict.status
            if timed_out:
                verdict.note = (verdict.note + "; " if verdict.note else "") + "killed at its timeout after writing its result"
        else:
            verdict = Verdict()
            if timed_out:
                status = "timeout"
                verdict.judge("ends within its timeout", False, f"killed after {running.timeout_s:.0f} s")
            else:
                status = "fail"
                verdict.judge("check process wrote a result", False, f"exit {running.process.returncode}: see the log")
        result = {"name": running.check.name, "measures": running.check.measures, **verdict.to_dict(),
                  "status": status, "wall_s": wall, "timeout_s": running.timeout_s}
        if status in ("fail", "timeout"):
            result["log_tail"] = tail(running.work / "log.txt", LOG_TAIL_LINES)
        self.note(f"[gpu kit] {status:<7} {running.check.name} {wall:.0f} s  {figures_cell(verdict.figures)[:300]}")
        return result

    def run(self, checks: list[Check]) -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + self.budget_s
        results: dict[str, dict[str, Any]] = {}
        running: list[Running] = []
        blocked = ""

        def reap(block: bool, room: int) -> None:
            """Collect finished (or overdue) checks; with ``block``, until fewer than ``room`` run."""
            while running:
                for item in list(running):
                    overdue = time.monotonic() - item.started > item.timeout_s
                    if item.process.poll() is not None or overdue:
                        running.remove(item)
                        results[item.check.name] = self.finish(item, timed_out=item.process.poll() is None)
                if not block or len(running) < room:
                    return
                time.sleep(0.2)

        for check in checks:
            if blocked:
                results[check.name] = skipped(check, blocked)
                continue
            solo = check.alone or check.required
            reap(block=True, room=1 if solo else self.jobs)
            item = self.start(check, deadline)
            if item is None:
                results[check.name] = skipped(check, f"not started: under {self.min_start_s:.0f} s of the "
                                                     f"{self.budget_s:.0f} s budget left")
                continue
            running.append(item)
            if solo:
                reap(block=True, room=1)
                if check.required and results[check.name]["status"] != "pass":
                    blocked = f"not started: the required check {check.name} did not pass"
        reap(block=True, room=1)
        ordered = [results[check.name] for check in checks]
        environment = next((r["figures"] for r in ordered if r["name"] == "environment"), {})
        summary = {
            "kit": "tools/gpu_check.sh",
            "mode": "cpu dry run" if self.cpu else "gpu",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(),
            "budget_s": self.budget_s,
            "jobs": self.jobs,
            "wall_s": time.monotonic() - started,
            "install_s": self.install_s,
            "environment": environment,
            "summary": report.summary(ordered),
            "checks": ordered,
        }
        json_path, md_path = report.write(summary, self.out)
        self.write_log(checks)
        self.note(f"[gpu kit] wrote {json_path}, {md_path} and {self.out / 'gpu_check.log'}")
        return summary

    def write_log(self, checks: list[Check]) -> None:
        with open(self.out / "gpu_check.log", "w") as log:
            install = self.work / "install.log"  # tools/gpu_check.sh --device writes it
            if install.is_file():
                log.write(f"===== install =====\n{install.read_text(errors='replace')}\n")
            log.write("\n".join(self.lines) + "\n")
            for check in checks:
                path = self.work / check.name / "log.txt"
                if path.is_file():
                    log.write(f"\n===== {check.name} =====\n")
                    log.write(path.read_text(errors="replace"))


def skipped(check: Check, why: str) -> dict[str, Any]:
    return {"name": check.name, "measures": check.measures, **Verdict(skipped=why).to_dict(), "wall_s": 0.0,
            "timeout_s": 0}


def stop(process: subprocess.Popen) -> None:
    """End a check's whole process group (rlhf may have started processes of its own)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
