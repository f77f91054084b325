"""The first check: what machine and software the others run on, and whether they can run at all."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from pathlib import Path

from tools.gpu_kit.runs import Context
from tools.gpu_kit.verdicts import Verdict

PACKAGES = ("torch", "transformers", "peft", "accelerate", "datasets", "pyarrow", "deepspeed", "pydantic",
            "typing-extensions", "bitsandbytes", "pytest")


def version_of(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment(ctx: Context) -> Verdict:
    import torch

    verdict = Verdict()
    figures = verdict.figures
    cuda = torch.cuda.is_available()
    if cuda:
        properties = torch.cuda.get_device_properties(0)
        figures["gpu"] = properties.name
        figures["gpu memory GiB"] = properties.total_memory / 2**30
        figures["bf16 supported"] = torch.cuda.is_bf16_supported()
    figures["python"] = platform.python_version()
    figures.update({name: version_of(name) for name in PACKAGES})
    figures["torch cuda"] = torch.version.cuda
    if ctx.cpu:
        verdict.judge("a CUDA GPU is visible", None, "not judged: the dry run runs on the CPU")
    else:
        verdict.judge("a CUDA GPU is visible", cuda, figures.get("gpu", "torch.cuda.is_available() is False"))

    import rlhf

    where = Path(rlhf.__file__).resolve().parent
    verdict.judge("rlhf imports from this checkout", where == (ctx.repo / "rlhf").resolve(), str(where))
    figures["rlhf-core"] = version_of("rlhf-core")
    for module in ("datasets", "rlhf.runtime.rl.local"):
        try:
            importlib.import_module(module)
            verdict.judge(f"import {module}", True)
        except Exception as exc:  # the bundle's install is what this finds out
            verdict.judge(f"import {module}", False, f"{type(exc).__name__}: {exc}")
    if figures["deepspeed"] == "absent":
        verdict.note = "deepspeed absent: the ZeRO checks will be skipped"
    return verdict
