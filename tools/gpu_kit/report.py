"""The run's summary: ``gpu_check.json`` (everything) and ``gpu_check.md`` (a table a person reads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NOT_CHECKED = (
    "vLLM and flash-attn: not installable on the lent device (no network; vLLM's wheel and CUDA libraries are "
    "hundreds of MB and pin their own torch, flash-attn compiles from source), so tests/vllm/test_gpu.py, "
    "benchmarks/vllm_throughput.py and the flash-attention test skip there (docs/vllm.md).",
    "Ray: not carried (its wheel alone is 76 MiB, over the 64 MiB a call carries); its runtime is tested on CPU.",
)
STATUSES = ("pass", "fail", "timeout", "skip")


def number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.4g}"
    return str(value)


def figures_cell(figures: dict[str, Any]) -> str:
    return "; ".join(f"{name} {number(value)}" for name, value in figures.items())


def criteria_cell(result: dict[str, Any]) -> str:
    if result.get("skipped"):
        return f"skipped: {result['skipped']}"
    parts = []
    for criterion in result.get("criteria", []):
        mark = {True: "ok", False: "FAIL", None: "not judged"}[criterion["ok"]]
        detail = f" ({criterion['detail']})" if criterion["detail"] and criterion["ok"] is not True else ""
        parts.append(f"{mark}: {criterion['name']}{detail}")
    return "; ".join(parts)


def escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary(results: list[dict[str, Any]]) -> dict[str, int]:
    return {status: sum(r["status"] == status for r in results) for status in STATUSES}


def markdown(report: dict[str, Any]) -> str:
    env = report.get("environment", {})
    machine = env.get("gpu") or ("CPU (dry run)" if report["mode"] != "gpu" else "no GPU found")
    counts = ", ".join(f"{n} {status}" for status, n in report["summary"].items() if n)
    lines = [
        f"# rlhf GPU check: {machine}, {report['date']}",
        "",
        f"Mode {report['mode']}; checks {report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget"
        + (f" after {report['install_s']:.0f} s of install" if report.get("install_s") is not None else "")
        + f", up to {report['jobs']} at a time; {counts}.",
        "Versions: " + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "torch cuda", "transformers", "peft",
                                                             "datasets", "deepspeed", "rlhf-core") if k in env) + ".",
        "",
        "| check | status | s | figures | criteria |",
        "|---|---|---|---|---|",
    ]
    for result in report["checks"]:
        lines.append(f"| {result['name']} | {result['status']} | {number(result['wall_s'])} | "
                     f"{escape(figures_cell(result['figures']))} | {escape(criteria_cell(result))} |")
    tests = [(result["name"], t) for result in report["checks"] for t in result.get("tests", [])]
    if tests:
        lines += ["", "| gpu test | outcome | s | figures or reason |", "|---|---|---|---|"]
        for _, test in tests:
            detail = figures_cell(test["figures"]) or test["message"]
            lines.append(f"| {escape(test['name'])} | {test['outcome']} | {number(test['time_s'])} | {escape(detail)} |")
    lines += ["", "Not checked by the kit:", *(f"- {line}" for line in NOT_CHECKED), ""]
    return "\n".join(lines)


def compact(report: dict[str, Any], width: int = 220) -> list[str]:
    """One line per check (status, name, seconds, and its figures, or its criteria when it did not
    pass), then the counts: the end of the output."""
    lines = [f"{r['status']:<7} {r['name']:<16} {number(r['wall_s']):>6} s  "
             f"{figures_cell(r['figures']) if r['status'] == 'pass' else criteria_cell(r)}"[:width]
             for r in report["checks"]]
    counts = ", ".join(f"{n} {status}" for status, n in report["summary"].items() if n)
    return [*lines, f"gpu kit: {counts} in {report['wall_s']:.0f} s; details in gpu_check.md and gpu_check.json"]


def write(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "gpu_check.json", out / "gpu_check.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path
