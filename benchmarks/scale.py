"""Scaling curves of a GRPO step: seconds per step and peak memory against length, group, vocabulary, model size.

Each axis varies one setting of a base point (`AXES`) and runs ``rlhf train --algo grpo`` (and
TRL's GRPOTrainer beside it when TRL is importable) on the random-weight Llamas of `benchlib`
(their EOS lies outside the vocabulary: every completion runs to the full length):

- ``length``: new tokens 32 -> 2048 (`small4k`: h256/L4, vocabulary 320, 4,096 positions), 2 prompts x 4
- ``group``:  samples per prompt n = 2 -> 32 (`small`), 2 prompts, 32 new tokens
- ``vocab``:  vocabulary 320 -> 32k -> 152k at h256/L4 (`small`, `small32k`, `small152k`), 4 prompts x 4,
  64 new tokens
- ``model``:  0.2M -> 500M parameters (`tiny`, `small`, `small32k`, `llama100m`, `llama500m`), full
  fine-tuning and LoRA (rank 16, every linear layer but the output head), 2 prompts x 2, 16 new tokens

Every point is one `benchmarks/harness.py` measurement (job ``grpo`` with the point's shape):
each side in a process of its own with its own interpreter, one torch thread, ``--rounds``
interleaved rounds, the first step of each run dropped; a point reports the median CPU seconds per
step, the min-max of the round medians and the side's peak resident set (``ru_maxrss``), and the
harness refuses a ratio when the two sides did not do the same work. Token-mean loss, β = 0,
micro-batches of up to 8, the dense reward (every sample trains on both sides). The parent prints
a table per axis, merges the points into ``OUT/scale.json`` (the axes not run keep their earlier
points) and draws ``OUT/scale_<axis>.png`` (CPU s/step and peak MB).

    python benchmarks/scale.py --axes length,group --trl-python /path/to/trl-venv/bin/python [--rounds 2]
    python benchmarks/scale.py --replot        # tables and PNGs again from OUT/scale.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

HERE = Path(__file__).resolve().parent
# axis -> the varied setting, its values, the base point, the x-axis label
AXES = {
    "length": dict(key="max_new_tokens", values=[32, 128, 512, 2048], label="new tokens per completion",
                   base=dict(model="small4k", prompts=2, n=4, max_new_tokens=32, lora_rank=0)),
    "group": dict(key="n", values=[2, 8, 32], label="samples per prompt (n)",
                  base=dict(model="small", prompts=2, n=4, max_new_tokens=32, lora_rank=0)),
    "vocab": dict(key="model", values=["small", "small32k", "small152k"], label="vocabulary (tokens)",
                  base=dict(model="small", prompts=4, n=4, max_new_tokens=64, lora_rank=0)),
    "model": dict(key="model", values=["tiny", "small", "small32k", "llama100m", "llama500m"],
                  label="parameters", modes=[0, 16],  # full fine-tuning, LoRA rank 16
                  base=dict(model="small", prompts=2, n=2, max_new_tokens=16, lora_rank=0)),
}
SIDES = ("rlhf", "trl")


def parameters(name: str) -> int:
    """A benchlib Llama's parameter count (attention 4h², MLP 3·h·4h, two norms a layer, the
    final norm, the embedding and an untied output layer)."""
    hidden, layers, vocab = benchlib.MODELS[name]
    per_layer = 16 * hidden * hidden + 2 * hidden
    return layers * per_layer + hidden + vocab * hidden * (1 if name in benchlib.TIED else 2)


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def measure(point: dict, sides: list[str], steps: int, args: argparse.Namespace, root: Path) -> dict[str, dict]:
    """One point through benchmarks/harness.py: each side in its own process, interleaved rounds."""
    shape = {k: point[k] for k in ("model", "prompts", "n", "max_new_tokens", "lora_rank")}
    shape["micro_batch_size"] = min(8, point["prompts"] * point["n"])
    out = root / "scale-point.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, str(HERE / "harness.py"), "--jobs", "grpo", "--sides", ",".join(sides),
               "--rounds", str(args.rounds), "--steps", str(steps), "--work-dir", str(root), "--json", str(out),
               "--set", ",".join(f"{k}={v}" for k, v in shape.items()), "--rlhf-python", args.rlhf_python]
    command += ["--trl-python", args.trl_python] if args.trl_python else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {side: {"error": f"over {args.timeout} s"} for side in sides}
    if done.returncode or not out.is_file():
        error = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [f"exit {done.returncode}"]
        return {side: {"error": error[0][:200]} for side in sides}
    job = json.loads(out.read_text())["jobs"]["grpo"]
    found = {side: {"s_per_step": s["wall"], "cpu_s_per_step": s["cpu"], "cpu_rounds": s["cpu_rounds"],
                    "peak_mb": s["peak_rss_mb"], "rounds": args.rounds} for side, s in job["sides"].items()}
    for side in found:
        found[side]["ratios"] = job["ratios"]
    return found


def points(axis: str) -> list[dict]:
    """The configurations of one axis: the base point with the axis's setting varied (and, for
    the model axis, each model fully fine-tuned and with LoRA)."""
    spec = AXES[axis]
    out = []
    for mode in spec.get("modes", [spec["base"]["lora_rank"]]):
        for value in spec["values"]:
            point = dict(spec["base"], lora_rank=mode, **{spec["key"]: value})
            x = parameters(value) if axis == "model" else benchlib.MODELS[value][2] if axis == "vocab" else value
            out.append(dict(point, axis=axis, x=x))
    return out


def series(point: dict) -> str:
    return point["side"] + (f" LoRA r{point['lora_rank']}" if point["lora_rank"] else "")


def run_axis(axis: str, args: argparse.Namespace, root: Path, have_trl: bool) -> list[dict]:
    results = []
    for point in points(axis):
        model = point["model"]
        if point["axis"] == "model" and parameters(model) > args.max_params:
            print(f"{axis}: {model} skipped (over --max-params {args.max_params:,})", flush=True)
            continue
        steps = args.big_steps if parameters(model) >= 3e8 else args.steps
        sides = [side for side in args.sides if side != "trl" or have_trl]
        need = parameters(model) * (4 if point["lora_rank"] else 16) / 2**20 * 1.5 + 1500
        if available_mb() < need:
            error = f"skipped: {available_mb():,.0f} MB available, about {need:,.0f} MB needed"
            results += [dict(point, side=side, steps=steps, error=error) for side in sides]
            print(f"{axis} {model}: {error}", flush=True)
            continue
        started = time.perf_counter()
        found = measure(point, sides, steps, args, root)
        for side in sides:
            result = dict(point, side=side, steps=steps, total_s=time.perf_counter() - started,
                          threads=1, **found[side])
            results.append(result)
            text = result.get("error") or (f"{result['cpu_s_per_step']:.3f} CPU s/step (rounds "
                                           f"{', '.join(f'{x:.3f}' for x in result['cpu_rounds'])}), "
                                           f"peak {result['peak_mb']:,.0f} MB")
            print(f"{axis} {point['model']} G={point['prompts']} n={point['n']} new={point['max_new_tokens']} "
                  f"{series(result)}: {text}  [{result['total_s']:.0f} s]", flush=True)
    return results


def x_text(point: dict) -> str:
    if point["axis"] == "model":
        return f"{point['model']} ({point['x'] / 1e6:.1f}M)"
    if point["axis"] == "vocab":
        return f"{point['x']:,}"
    return str(point["x"])


def table(axis: str, found: list[dict]) -> str:
    """A markdown table: one row per x (and LoRA mode), s/step wall and CPU and peak MB per side."""
    sides = [side for side in SIDES if any(p["side"] == side for p in found)]
    head = "| " + AXES[axis]["label"] + (" | mode" if axis == "model" else "") + " | " + " | ".join(
        f"{side} CPU s/step (round min-max) | {side} peak MB" for side in sides)
    head += " | TRL / rlhf CPU s, MB |" if len(sides) > 1 else " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    keys = []
    for p in found:
        if (p["x"], p["lora_rank"]) not in keys:
            keys.append((p["x"], p["lora_rank"]))
    for x, lora in keys:
        row = {p["side"]: p for p in found if p["x"] == x and p["lora_rank"] == lora}
        first = next(iter(row.values()))
        cells = [x_text(first)] + ([f"LoRA r{lora}" if lora else "full"] if axis == "model" else [])
        for side in sides:
            p = row.get(side)
            if p is None or p.get("error"):
                cells += [(p or {}).get("error", "not run"), "-"]
            else:
                spread = p.get("cpu_rounds") or [p["cpu_s_per_step"]]
                cells += [f"{p['cpu_s_per_step']:.2f} ({min(spread):.2f}-{max(spread):.2f})", f"{p['peak_mb']:,.0f}"]
        if len(sides) > 1:
            a, b = row.get("rlhf"), row.get("trl")
            ok = a and b and not a.get("error") and not b.get("error")
            verdict = (a or {}).get("ratios", {}).get("trl/rlhf", "")  # the harness's: refused when work differs
            if verdict.startswith("work differs"):
                cells.append(verdict)
            elif ok:
                spread = verdict.split(" ")[2].rstrip(",") if verdict.startswith("trl/rlhf") else ""
                cells.append(f"{b['cpu_s_per_step'] / a['cpu_s_per_step']:.2f}x {spread}, "
                             f"{b['peak_mb'] / a['peak_mb']:.2f}x")
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(axis: str, found: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(10, 4))
    names = []
    for p in found:
        if series(p) not in names:
            names.append(series(p))
    for name in names:
        ok = sorted((p for p in found if series(p) == name and not p.get("error")), key=lambda p: p["x"])
        if not ok:
            continue
        style = dict(marker="o", color="tab:blue" if name.startswith("rlhf") else "tab:orange",
                     linestyle="--" if "LoRA" in name else "-", label=name)
        panels[0].plot([p["x"] for p in ok], [p["cpu_s_per_step"] for p in ok], **style)
        panels[1].plot([p["x"] for p in ok], [p["peak_mb"] for p in ok], **style)
    xs = [p["x"] for p in found]
    for panel, title in zip(panels, ("CPU seconds per step (median)", "peak resident memory (MB)")):
        if max(xs) / min(xs) >= 10:
            panel.set_xscale("log")
        if axis in ("model", "vocab", "length"):
            panel.set_yscale("log")
        panel.set_xlabel(AXES[axis]["label"])
        panel.set_title(title)
        panel.grid(True, which="both", alpha=0.3)
        panel.legend()
    base = AXES[axis]["base"]
    fixed = {k: v for k, v in base.items() if k not in (AXES[axis]["key"], "lora_rank")}
    figure.suptitle(f"GRPO step, {axis} axis  ({', '.join(f'{k}={v}' for k, v in fixed.items())}; one torch thread)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def report(found: list[dict], out: Path) -> None:
    for axis in AXES:
        mine = [p for p in found if p["axis"] == axis]
        if not mine:
            continue
        print(f"\n{axis}: {AXES[axis]['key']} varies; base {AXES[axis]['base']}")
        print(table(axis, mine))
        try:
            plot(axis, mine, out / f"scale_{axis}.png")
        except ImportError:
            print("(matplotlib not importable here: no PNG; run --replot with a Python that has it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--axes", default="length,group,vocab,model", help="comma-separated: " + ", ".join(AXES))
    parser.add_argument("--sides", default="rlhf,trl", help="comma-separated: rlhf, trl (trl: when importable)")
    parser.add_argument("--out", default=str(HERE), help="scale.json and scale_<axis>.png go here")
    parser.add_argument("--steps", type=int, default=3, help="steps per point (the first is dropped)")
    parser.add_argument("--big-steps", type=int, default=2, help="steps per point for models of 300M parameters up")
    parser.add_argument("--max-params", type=float, default=1e9, help="leave out models above this many parameters")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a point may run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per point (benchmarks/harness.py)")
    parser.add_argument("--rlhf-python", default=sys.executable, help="interpreter with rlhf")
    parser.add_argument("--trl-python", default=None, help="interpreter with TRL (the trl side runs only with it)")
    parser.add_argument("--work-dir", default=None, help="models and run folders (default: a temp folder)")
    parser.add_argument("--replot", action="store_true", help="only the tables and PNGs, from OUT/scale.json")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "scale.json"
    saved = json.loads(store.read_text()) if store.is_file() else {"points": []}
    if args.replot:
        print(saved.get("machine", ""))
        return report(saved["points"], out)

    args.sides = args.sides.split(",")
    axes = args.axes.split(",")
    unknown = set(axes) - AXES.keys()
    if unknown:
        parser.error(f"unknown axes: {', '.join(sorted(unknown))}")
    have_trl = bool(args.trl_python)
    if not have_trl and "trl" in args.sides:
        print("no --trl-python: rlhf only (benchmarks/README.md says how to make TRL's environment)")
    root = benchlib.work_dir(args.work_dir)
    machine = benchlib.machine_line(1)
    print(machine)
    kept = [p for p in saved["points"] if p["axis"] not in axes]
    for axis in axes:
        kept += run_axis(axis, args, root, have_trl)
        store.write_text(json.dumps({"machine": machine, "points": kept}, indent=1) + "\n")
    report(kept, out)


if __name__ == "__main__":
    main()
