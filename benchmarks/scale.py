"""Scaling curves of a GRPO step: seconds per step and peak memory against length, group, vocabulary, model size.

Each axis varies one setting of a base point (`AXES`) and runs ``rlhf train --algo grpo`` (and
TRL's GRPOTrainer beside it when TRL is importable) on the random-weight Llamas of `benchlib`
(their EOS lies outside the vocabulary: every completion runs to the full length):

- ``length``: new tokens 32 -> 1024 (`small2k`: h256/L4, vocabulary 320, 2,048 positions), 2 prompts x 4
- ``group``:  samples per prompt n = 2 -> 32 (`small`), 2 prompts, 32 new tokens
- ``vocab``:  vocabulary 320 -> 32k -> 152k at h256/L4 (`small`, `small32k`, `small152k`), 4 prompts x 4,
  64 new tokens
- ``model``:  0.2M -> 500M parameters (`tiny`, `small`, `small32k`, `llama100m`, `llama500m`), full
  fine-tuning and LoRA (rank 16, every linear layer but the output head), 2 prompts x 2, 16 new tokens

Every point runs in a fresh child process (one side, one configuration), so its peak resident
set (``VmHWM``, benchmarks/vocab_memory.py) is its own; the child reports the median seconds per
step (wall and CPU; the first step dropped) and its peak. One torch thread by default, token-mean
loss, β = 0 (no reference model), micro-batches of up to 8, the dense reward (every sample trains
on both sides). The parent prints a table per axis, merges the points into ``OUT/scale.json`` (the
axes not run keep their earlier points) and draws ``OUT/scale_<axis>.png`` (s/step and peak MB).

    PYTHONPATH=. /work/trl-venv/bin/python benchmarks/scale.py --axes length,group,vocab,model --threads 1
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
    "length": dict(key="max_new_tokens", values=[32, 128, 512, 1024], label="new tokens per completion",
                   base=dict(model="small2k", prompts=2, n=4, max_new_tokens=32, lora_rank=0)),
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


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def child(spec: dict) -> None:
    """One point, one side, in this process; prints one JSON line."""
    threads = benchlib.setup_environment(spec["threads"])
    import vs_trl

    root = Path(spec["work_dir"])
    data, reward = benchlib.write_task(root)
    args = argparse.Namespace(
        prompts=spec["prompts"], n=spec["n"], max_new_tokens=spec["max_new_tokens"],
        micro_batch_size=min(8, spec["prompts"] * spec["n"]), steps=spec["steps"], lr=1e-4, seed=0, kl_coef=0.0,
        share_prompt=True, cpu_linear="auto", reward="count_a_dense")
    run_dir = root / "runs" / f"scale-{spec['side']}"
    if spec["side"] == "rlhf":
        if spec["lora_rank"]:
            vs_trl.OURS_EXTRA["lora_rank"] = spec["lora_rank"]
        clock = vs_trl.run_ours(args, Path(spec["model_dir"]), data, reward, run_dir)
    else:
        if spec["lora_rank"]:
            from peft import LoraConfig

            vs_trl.TRL_EXTRA["peft_config"] = LoraConfig(r=spec["lora_rank"], lora_alpha=16, lora_dropout=0.0,
                                                         target_modules="all-linear", task_type="CAUSAL_LM")
        clock = vs_trl.run_trl(args, Path(spec["model_dir"]), data, reward, run_dir)
    print(json.dumps({"threads": threads, "peak_mb": peak_mb(), "step_s": clock.intervals,
                      "s_per_step": benchlib.median(benchlib.steady(clock.intervals)),
                      "cpu_s_per_step": benchlib.median(benchlib.steady(clock.cpu_intervals))}))


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
        model_dir = benchlib.model_dir(model, root)
        for side in args.sides:
            if side == "trl" and not have_trl:
                continue
            need = parameters(model) * (4 if point["lora_rank"] else 16) / 2**20 * 1.5 + 1500
            if available_mb() < need:
                error = f"skipped: {available_mb():,.0f} MB available, about {need:,.0f} MB needed"
                results.append(dict(point, side=side, steps=steps, error=error))
                print(f"{axis} {model} {series(results[-1])}: {results[-1]['error']}", flush=True)
                continue
            spec = dict(point, side=side, steps=steps, threads=args.threads, model_dir=str(model_dir),
                        work_dir=str(root))
            started = time.perf_counter()
            try:
                done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                      text=True, timeout=args.timeout)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                found = json.loads(lines[-1]) if not done.returncode and lines else {
                    "error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ''}"}
            except subprocess.TimeoutExpired:
                found = {"error": f"over {args.timeout} s"}
            result = dict(point, side=side, steps=steps, total_s=time.perf_counter() - started,
                          **{"threads": args.threads, **found})
            results.append(result)
            text = result.get("error") or (f"{result['s_per_step']:.3f} s/step ({result['cpu_s_per_step']:.3f} CPU), "
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
        f"{side} s/step (CPU) | {side} peak MB" for side in sides)
    head += " | TRL / rlhf s, MB |" if len(sides) > 1 else " |"
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
                cells += [f"{p['s_per_step']:.2f} ({p['cpu_s_per_step']:.2f})", f"{p['peak_mb']:,.0f}"]
        if len(sides) > 1:
            a, b = row.get("rlhf"), row.get("trl")
            ok = a and b and not a.get("error") and not b.get("error")
            cells.append(f"{b['s_per_step'] / a['s_per_step']:.2f}x, {b['peak_mb'] / a['peak_mb']:.2f}x" if ok else "-")
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
        panels[0].plot([p["x"] for p in ok], [p["s_per_step"] for p in ok], **style)
        panels[1].plot([p["x"] for p in ok], [p["peak_mb"] for p in ok], **style)
    xs = [p["x"] for p in found]
    for panel, title in zip(panels, ("seconds per step (wall, median)", "peak resident memory (MB)")):
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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work-dir", default=None, help="models and run folders (default: a temp folder)")
    parser.add_argument("--replot", action="store_true", help="only the tables and PNGs, from OUT/scale.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))

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
    benchlib.setup_environment(args.threads)
    try:
        import trl  # noqa: F401
        have_trl = True
    except ImportError:
        have_trl = False
        print("trl: not importable in this Python, rlhf only (see benchmarks/vs_trl.py for a venv with both)")
    root = benchlib.work_dir(args.work_dir)
    machine = benchlib.machine_line(args.threads)
    print(machine)
    kept = [p for p in saved["points"] if p["axis"] not in axes]
    for axis in axes:
        kept += run_axis(axis, args, root, have_trl)
        store.write_text(json.dumps({"machine": machine, "points": kept}, indent=1) + "\n")
    report(kept, out)


if __name__ == "__main__":
    main()
