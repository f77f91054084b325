"""Which of the package's files one training step runs through, measured on the tiny example model.

    python -m tools.step_files rl      # one GRPO step of ``rlhf train``
    python -m tools.step_files dpo     # one step of ``rlhf dpo``
    python -m tools.step_files rl --plain    # with every fast path switched off

Two counts, from the command line's ``main()`` to the first ``optimizer.step()``:

* the reading path: the files on the call stack wherever the step hands over to a plugin or to the
  user's code (the engine's generate, the environment, the reward function, the advantage
  estimator, the policy loss, the KL estimator, the aggregation, the objective, the backend's
  backward and step) and wherever log-probs are computed: the files a reader opens following the
  step from the command to the update;
* every file with a function that runs during the step (from the trainer's step, or the fit
  loop's, to ``optimizer.step()``; the module and class bodies a lazy import runs left out).

docs/architecture.md ("Reading one step") gives the figures.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "rlhf") + os.sep
PLUGINS = PACKAGE + "plugins" + os.sep
LOGPROBS = PACKAGE + os.path.join("core", "logprobs.py")


PLAIN = ["--no-share-prompt", "--no-vocab-chunks", "--no-in-place-gradients", "--cpu-linear", "torch"]  # every fast path off (with the RL
# step's ``--engine.decoder direct``)


def command(kind: str, out: str, plain: bool = False) -> list[str]:
    model, data = str(ROOT / "examples" / "tiny-model"), ROOT / "examples"
    if kind == "rl":
        return ["train", "--algo", "grpo", "--model", model, "--data", str(data / "data" / "train.jsonl"),
                "--input-key", "prompt", "--label-key", "answer", "--reward", f"{data / 'rewards.py'}:exact_match",
                "--n-samples", "4", "--prompts-per-step", "2", "--max-new-tokens", "8", "--steps", "1",
                "--no-progress", "--out", out] + (PLAIN + ["--engine.decoder", "direct"] if plain else [])
    return ["dpo", "--model", model, "--data", str(data / "pipeline" / "pairs.jsonl"), "--max-samples", "8",
            "--batch-size", "4", "--steps", "1", "--no-progress", "--out", out] + (PLAIN if plain else [])


def _hands_over(code: Any, filename: str) -> bool:
    """A call the reading path leads to: plugin or user code (the example's reward function), or the
    log-prob computation."""
    if filename.startswith(PLUGINS):
        return not filename.startswith(PLUGINS + "loggers")  # loggers watch the step, they are not part of it
    if filename == LOGPROBS:
        return code.co_name == "token_logprobs"
    return filename.startswith(str(ROOT / "examples"))  # the user's reward function


@dataclass
class StepFiles:
    reading: list[str]  # the reading path
    running: list[str]  # every file with a function that runs in the step
    handovers: dict[str, str]  # plugin or user function -> the package file that calls it
    stages: dict[str, list[str]]  # the reading path of each part of the step, named by the call the loop's step makes


RL_LOOP = os.path.join("runtime", "rl", "trainer.py")
FIT_LOOP = os.path.join("runtime", "fit", "loop.py")
BATCH_MAKING = os.path.join("runtime", "rl", "batches.py")  # the RL step's own: the parts of its batch


def _is_loop_step(code: Any) -> bool:
    return code.co_name == "step" and code.co_filename.endswith((RL_LOOP, FIT_LOOP))


def measure(kind: str, plain: bool = False) -> StepFiles:
    """One step of ``kind`` (``plain``: with every fast path switched off)."""
    reading: set[str] = set()
    handovers: dict[str, str] = {}
    running: set[str] = set()
    stages: dict[str, set[str]] = {}
    state = {"in_step": False, "done": False}

    def relative(path: str) -> str:
        return path[len(PACKAGE):]

    def stage_of(callers: list[Any]) -> str:
        """The call the loop's step makes that leads here (outside the loop's own files: its step's
        and, for RL, the batch making's, which calls the rollout and the scoring)."""
        outermost_first = callers[::-1]
        for index, code in enumerate(outermost_first):
            if _is_loop_step(code):
                for inner in outermost_first[index + 1:]:
                    if inner.co_filename != code.co_filename and not inner.co_filename.endswith(BATCH_MAKING):
                        return f"{relative(inner.co_filename)}:{inner.co_name}"
                return f"{relative(code.co_filename)}:step"  # the step's own call
        return "?"

    def profile(frame: Any, event: str, arg: Any) -> None:
        if state["done"] or event != "call":
            return
        code = frame.f_code
        filename = code.co_filename
        if _is_loop_step(code):
            state["in_step"] = True
        if state["in_step"] and filename.startswith(PACKAGE) and code.co_flags & inspect.CO_OPTIMIZED:  # functions,
            # not the bodies of modules or classes a lazy import runs
            running.add(relative(filename))
        if state["in_step"] and _hands_over(code, filename):
            callers, caller = [], frame.f_back
            while caller is not None:
                callers.append(caller.f_code)
                caller = caller.f_back
            if not any(_hands_over(c, c.co_filename) for c in callers):  # the host's own hand-over, not a callback
                path = {relative(c.co_filename) for c in callers if c.co_filename.startswith(PACKAGE)}
                if filename.startswith(PACKAGE):
                    path.add(relative(filename))
                reading.update(path)
                stages.setdefault(stage_of(callers), set()).update(path)
                host = next((c.co_filename for c in callers if c.co_filename.startswith(PACKAGE)), "")
                where = relative(filename) if filename.startswith(PACKAGE) else Path(filename).name
                handovers.setdefault(f"{where}:{code.co_name}", relative(host))
        if state["in_step"] and code.co_name == "step" and filename.startswith(PLUGINS + "backends"):
            state["done"] = True

    from rlhf.cli.main import main

    with tempfile.TemporaryDirectory() as out:
        sys.setprofile(profile)
        threading.setprofile(profile)
        try:
            main(command(kind, str(Path(out) / "run"), plain))
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                raise RuntimeError(f"the measured {kind} run failed (exit {exit_.code}): see its output above") from None
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    if not state["done"]:
        raise RuntimeError(f"the measured {kind} run never reached optimizer.step()")
    return StepFiles(sorted(reading), sorted(running), handovers,
                     {name: sorted(files) for name, files in stages.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["rl", "dpo"])
    parser.add_argument("--plain", action="store_true", help="every fast path switched off")
    args = parser.parse_args(argv)
    files = measure(args.kind, args.plain)
    print(f"reading path: {len(files.reading)} files")
    for name in files.reading:
        print("  ", name)
    print("by the part of the step it reads (from main() too):")
    for stage, path in files.stages.items():
        print(f"   {stage}: {len(path)} files")
    print("hand-overs (called <- caller):")
    for called, caller in sorted(files.handovers.items()):
        print("  ", called, "<-", caller)
    print(f"every file the step runs: {len(files.running)}")
    for name in files.running:
        print("  ", name)


if __name__ == "__main__":
    main()
