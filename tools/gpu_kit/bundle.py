"""The wheel bundle the device installs without network: this checkout and what its image lacks.

The device image (Python 3.12, torch with CUDA, transformers, peft, pyarrow, pytest, ...) lacks
rlhf's `datasets` and `importlib-metadata`, the tests' `pexpect`, DeepSpeed with its `pydantic`
and `hjson`, and bitsandbytes (QLoRA). Each is pinned here to the release this project is tested with; wheels are
fetched for CPython 3.12 on manylinux x86-64 (pure-Python ones are the same everywhere), and
DeepSpeed, which ships only as source, is built here as a pure-Python wheel (``DS_BUILD_OPS=0``:
no compiled ops, none of which rlhf's configurations need). Ray (hundreds of MB), vLLM and
flash-attn (wheels over the transfer limit, CUDA builds) do not travel: the checks that need them
report themselves skipped.

What travels to the device (the working tree plus the carried bundle) must stay under
`TRANSFER_LIMIT`: `measure` prints both and `check_size` fails loudly over it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TRANSFER_LIMIT = 64 * 2**20  # bytes: the working tree and every carried path, together
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DEVICE_PYTHON = "3.12"
PROJECT = "rlhf-core"


@dataclass(frozen=True)
class Pin:
    name: str  # distribution name, as pip spells it
    version: str
    why: str
    source: str = "download"  # "download": a wheel from the registry; "build": built here from its sdist


PINS = (
    Pin("datasets", "5.2.0", "rlhf reads every data file through it"),
    Pin("dill", "0.4.1", "datasets"),
    Pin("multiprocess", "0.70.19", "datasets (its py312 wheel)"),
    Pin("importlib-metadata", "10.2.0", "rlhf's plugin discovery"),
    Pin("lazy-importer", "0.1.0", "importlib-metadata on Python < 3.15"),
    Pin("pexpect", "4.9.0", "the tests' terminal sessions (dev extra)"),
    Pin("ptyprocess", "0.7.0", "pexpect"),
    Pin("deepspeed", "0.19.8", "--backend deepspeed (built here: pure Python, no compiled ops)", "build"),
    Pin("hjson", "3.1.0", "deepspeed"),
    Pin("pydantic", "2.14.4", "deepspeed's config"),
    Pin("pydantic-core", "2.50.5", "pydantic (cp312 manylinux wheel)"),
    Pin("annotated-types", "0.8.0", "pydantic"),
    Pin("typing-inspection", "0.4.5", "pydantic"),
    Pin("bitsandbytes", "0.50.2", "QLoRA (--load-in-4bit); 41 MiB, its CUDA 13.0 kernels included"),
    Pin("typing-extensions", "4.16.0", "pydantic-core needs 4.14+ (typing_extensions.Sentinel); the image's release is not known"),
)


def wheel_prefix(name: str) -> str:
    """How a wheel's file name begins for distribution ``name`` (``pydantic-core`` -> ``pydantic_core-``)."""
    return name.replace("-", "_").lower() + "-"


def wheels_of(directory: Path, name: str) -> list[Path]:
    prefix = wheel_prefix(name)
    return sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix)
                  and p.name[len(prefix)].isdigit())


def pinned_wheel(directory: Path, pin: Pin) -> Path | None:
    """The bundle's wheel of ``pin`` at its pinned version, if present."""
    found = [p for p in wheels_of(directory, pin.name) if p.name[len(wheel_prefix(pin.name)):].startswith(pin.version + "-")]
    return found[0] if found else None


def drop_other_versions(directory: Path, name: str, keep: Path | None) -> list[Path]:
    """Remove ``name``'s wheels other than ``keep``: two versions of one package stop the device's install."""
    dropped = [p for p in wheels_of(directory, name) if p != keep]
    for path in dropped:
        path.unlink()
    return dropped


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    command = [sys.executable, "-m", "pip", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"gpu kit: `{' '.join(command)}` failed (exit {result.returncode}): "
                         f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'no output'}")


def fetch(directory: Path, pin: Pin) -> Path:
    """Download (or build) ``pin``'s wheel for the device into ``directory``."""
    if pin.source == "build":
        # setup.py imports torch: build against this environment's, without an isolated build env
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(directory), f"{pin.name}=={pin.version}",
            env={**os.environ, "DS_BUILD_OPS": "0"})
    else:
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", DEVICE_PYTHON,
            "--implementation", "cp", *platforms, "-d", str(directory), f"{pin.name}=={pin.version}")
    wheel = pinned_wheel(directory, pin)
    if wheel is None:
        raise SystemExit(f"gpu kit: no wheel of {pin.name}=={pin.version} in {directory} after fetching it; "
                         "check the pin in tools/gpu_kit/bundle.py")
    return wheel


def build_project(directory: Path, repo: Path) -> Path:
    """This checkout as a wheel (offline: setuptools from this environment). On the device the
    checkout itself comes first on PYTHONPATH; the wheel gives it its distribution metadata."""
    for old in wheels_of(directory, PROJECT):
        old.unlink()
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(directory), str(repo))
    built = wheels_of(directory, PROJECT)
    if len(built) != 1:
        raise SystemExit(f"gpu kit: building {repo} gave {len(built)} {PROJECT} wheels in {directory}, not one")
    return built[0]


@dataclass
class BundleEntry:
    name: str
    version: str
    why: str
    wheel: Path | None  # None: not in the bundle (not downloaded)

    @property
    def size(self) -> int:
        return self.wheel.stat().st_size if self.wheel else 0


def build_bundle(directory: Path, repo: Path, *, download: bool, leave_out: tuple[str, ...] = ()) -> list[BundleEntry]:
    """The bundle in ``directory``: this checkout's wheel, and every pin not in ``leave_out`` (fetched
    unless present; with ``download`` false, only what is already there). A left-out pin's wheels
    are removed, so they do not travel."""
    unknown = sorted(set(leave_out) - {pin.name for pin in PINS})
    if unknown:
        raise SystemExit(f"gpu kit: --leave-out {', '.join(unknown)}: not in the bundle; it holds "
                         f"{', '.join(pin.name for pin in PINS)}")
    directory.mkdir(parents=True, exist_ok=True)
    project = build_project(directory, repo)
    entries = [BundleEntry(PROJECT, project.name.split("-")[1], "this checkout", project)]
    for pin in PINS:
        if pin.name in leave_out:
            drop_other_versions(directory, pin.name, None)
            continue
        wheel = pinned_wheel(directory, pin)
        if wheel is None and download:
            wheel = fetch(directory, pin)
        drop_other_versions(directory, pin.name, wheel)
        entries.append(BundleEntry(pin.name, pin.version, pin.why, wheel))
    return entries


def tree_size(repo: Path) -> int:
    """Bytes of what travels without being carried: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        raise SystemExit(f"gpu kit: `git ls-files` failed in {repo}: {listed.stderr.strip()}")
    paths = {repo / name for name in listed.stdout.split("\0") if name}
    return sum(path.stat().st_size for path in paths if path.is_file())


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def describe(entries: list[BundleEntry], directory: Path, tree: int, limit: int = TRANSFER_LIMIT) -> list[str]:
    """Lines that list the bundle and the transfer's size against ``limit``."""
    lines = [f"bundle {directory}:"]
    for entry in entries:
        size = f"{entry.size / 2**10:.0f} KiB" if entry.size < 2**20 else mib(entry.size)
        where = f"{size:>9}  {entry.wheel.name}" if entry.wheel else "           not downloaded (--no-download)"
        lines.append(f"  {entry.name + '==' + entry.version:<28}{where:<95} {entry.why}")
    bundle = sum(entry.size for entry in entries)
    missing = sum(entry.wheel is None for entry in entries)
    total = tree + bundle
    lines.append(f"size: working tree {mib(tree)} + bundle {mib(bundle)} = {mib(total)} of the {mib(limit)} transfer limit"
                 + (f" ({missing} wheels not downloaded, not counted)" if missing else ""))
    return lines


def check_size(tree: int, bundle: int, limit: int = TRANSFER_LIMIT) -> None:
    if tree + bundle > limit:
        raise SystemExit(f"gpu kit: the working tree ({mib(tree)}) and the bundle ({mib(bundle)}) are "
                         f"{mib(tree + bundle)}, over the {mib(limit)} the device call carries: leave the "
                         "largest out (--leave-out bitsandbytes) or ignore large untracked files")
