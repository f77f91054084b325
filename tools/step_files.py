"""Which of the package's files one training step runs through, measured on the tiny example model.

    python -m tools.step_files rl      # one GRPO step of ``rlhf train``
    python -m tools.step_files dpo     # one step of ``rlhf dpo``

Two counts, from the command line's ``main()`` to the first ``optimizer.step()``:

* the reading path: the files on the call stack wherever the step hands over to a plugin or to the
  user's code (the engine's generate, the environment, the reward function, the advantage
  estimator, the policy loss, the KL estimator, the aggregation, the objective, the backend's
  backward and step) and wherever log-probs are computed: the files a reader opens following the
  step from the command to the update;
* every file with a function that runs during the step (from the trainer's step, or the fit
  loop's, to ``optimizer.step()``; module import code left out).

docs/architecture.md ("Reading one step") gives the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "rlhf") + os.sep
PLUGINS = PACKAGE + "plugins" + os.sep
LOGPROBS = PACKAGE + os.path.join("core", "logprobs.py")


def command(kind: str, out: str) -> list[str]:
    model, data = str(ROOT / "examples" / "tiny-model"), ROOT / "examples"
    if kind == "rl":
        return ["train", "--algo", "grpo", "--model", model, "--data", str(data / "data" / "train.jsonl"),
                "--input-key", "prompt", "--label-key", "answer", "--reward", f"{data / 'rewards.py'}:exact_match",
                "--n-samples", "4", "--prompts-per-step", "2", "--max-new-tokens", "8", "--steps", "1",
                "--no-progress", "--out", out]
    return ["dpo", "--model", model, "--data", str(data / "pipeline" / "pairs.jsonl"), "--max-samples", "8",
            "--batch-size", "4", "--steps", "1", "--no-progress", "--out", out]


def _hands_over(code: object, filename: str) -> bool:
    """A call the reading path leads to: plugin or user code (the example's reward function), or the
    log-prob computation."""
    if filename.startswith(PLUGINS):
        return not filename.startswith(PLUGINS + "loggers")  # loggers watch the step, they are not part of it
    if filename == LOGPROBS:
        return code.co_name == "token_logprobs"
    return filename.startswith(str(ROOT / "examples"))  # the user's reward function


def measure(kind: str) -> tuple[list[str], list[str], dict[str, str]]:
    """(reading path, every file the step runs, {plugin or user function: the package file that calls it})."""
    reading: set[str] = set()
    handovers: dict[str, str] = {}
    running: set[str] = set()
    state = {"in_step": False, "done": False}

    def relative(path: str) -> str:
        return path[len(PACKAGE):]

    def profile(frame, event, arg):  # noqa: ANN001
        if state["done"] or event != "call":
            return
        code = frame.f_code
        filename = code.co_filename
        if code.co_name == "step" and filename.endswith(os.path.join("runtime", "trainer.py")) or \
                code.co_name == "step" and filename.endswith(os.path.join("runtime", "fit", "loop.py")):
            state["in_step"] = True
        if state["in_step"] and filename.startswith(PACKAGE) and code.co_name != "<module>":
            running.add(relative(filename))
        if state["in_step"] and _hands_over(code, filename):
            callers, caller = [], frame.f_back
            while caller is not None:
                callers.append(caller.f_code)
                caller = caller.f_back
            if not any(_hands_over(c, c.co_filename) for c in callers):  # the host's own hand-over, not a callback
                reading.update(relative(c.co_filename) for c in callers if c.co_filename.startswith(PACKAGE))
                host = next((c.co_filename for c in callers if c.co_filename.startswith(PACKAGE)), "")
                where = relative(filename) if filename.startswith(PACKAGE) else Path(filename).name
                handovers.setdefault(f"{where}:{code.co_name}", relative(host))
                if filename.startswith(PACKAGE):
                    reading.add(relative(filename))
        if state["in_step"] and code.co_name == "step" and filename.startswith(PLUGINS + "backends"):
            state["done"] = True

    from rlhf.cli.main import main

    with tempfile.TemporaryDirectory() as out:
        sys.setprofile(profile)
        threading.setprofile(profile)
        try:
            main(command(kind, str(Path(out) / "run")))
        except SystemExit:
            pass
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    return sorted(reading), sorted(running), handovers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["rl", "dpo"])
    args = parser.parse_args(argv)
    reading, running, handovers = measure(args.kind)
    print(f"reading path: {len(reading)} files")
    for name in reading:
        print("  ", name)
    print("hand-overs (called <- caller):")
    for called, caller in sorted(handovers.items()):
        print("  ", called, "<-", caller)
    print(f"every file the step runs: {len(running)}")
    for name in running:
        print("  ", name)


if __name__ == "__main__":
    main()
