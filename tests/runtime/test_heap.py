"""Freed blocks go back to the system (rlhf/runtime/run/heap.py): in a fresh process, a 16 MiB tensor
freed after a 24 MiB one (which raises glibc's threshold) stays resident without the setting and is
returned with it; a user's MALLOC_MMAP_THRESHOLD_ is left alone; every run's prologue sets it, at 32 MiB
for a model whose weights take under 128 MiB and 1 MiB otherwise. oneDNN's compiled kernels: a process
that meets 300 product shapes and then its first ten again compiles those ten anew with the bound
and none of them without; a user's own capacities are kept; every run's prologue bounds them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import sys
from rlhf.runtime.run.heap import return_freed_blocks
if sys.argv[1] == "set":
    assert return_freed_blocks()
import torch

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

big = torch.ones(6 * 2**20)  # 24 MiB, mapped; freeing it raises glibc's threshold to 24 MiB
del big
before = resident_mib()
block = torch.ones(4 * 2**20)  # 16 MiB: from the heap once the threshold rose
pin = torch.ones(16)  # a small block above it keeps the heap from shrinking
del block
print(resident_mib() - before)
"""


def resident_after_free(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


@pytest.mark.unit
@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc only")
def test_a_freed_block_is_returned_with_the_setting_and_kept_without():
    assert resident_after_free("keep") > 12  # MiB still resident after the free
    assert resident_after_free("set") < 4


@pytest.mark.unit
def test_a_users_own_threshold_is_kept(monkeypatch):
    from rlhf.runtime.run.heap import return_freed_blocks

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_freed_blocks() is False


@pytest.mark.run
def test_every_run_prologue_sets_it(tiny_model_dir, task, tmp_path, plugins, monkeypatch):
    from rlhf.runtime.run import lifecycle
    from tests.helpers import run_cli

    calls, bounds = [], []
    monkeypatch.setattr(lifecycle, "return_freed_blocks", lambda *threshold: calls.append(threshold) or True)
    monkeypatch.setattr(lifecycle, "bound_kernel_caches", lambda: bounds.append(True) or [])
    for command in (["train", "--reward", "examples/rewards.py:exact_match", "--label-key", "answer",
                     "--max-new-tokens", "4", "--prompts-per-step", "2", "--n-samples", "2"],
                    ["sft", "--input-key", "prompt", "--output-key", "answer", "--batch-size", "2"]):
        result = run_cli(plugins, [*command, "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                                   "--steps", "1", "--out", str(tmp_path / command[0]), "--no-progress"])
        assert result.exit_code == 0, result.output
    assert len(calls) == len(bounds) == 2
    assert calls == [(32 << 20,), (32 << 20,)]  # the tiny model's weights: a small model's threshold


@pytest.mark.unit
def test_the_threshold_follows_the_size_of_the_weights(tmp_path):
    from rlhf.runtime.run.heap import MMAP_THRESHOLD, SMALL_MODEL_BYTES, SMALL_MODEL_THRESHOLD, threshold_for

    small, large = tmp_path / "small", tmp_path / "large"
    for folder, size in ((small, SMALL_MODEL_BYTES - 1), (large, SMALL_MODEL_BYTES)):
        folder.mkdir()
        with open(folder / "model.safetensors", "wb") as handle:
            handle.truncate(size)  # sparse: no disk used
        (folder / "tokenizer.json").write_text("{}" * 1000)  # not weights
    assert threshold_for(str(small)) == SMALL_MODEL_THRESHOLD == 32 << 20
    assert threshold_for(str(large)) == MMAP_THRESHOLD == 1 << 20
    assert threshold_for("Qwen/Qwen2.5-0.5B") == MMAP_THRESHOLD  # not local: memory first
    assert threshold_for(str(tmp_path / "missing")) == threshold_for(None) == MMAP_THRESHOLD


KERNELS_PROBE = """
import sys
if sys.argv[1] == "bound":
    from rlhf.runtime.run.heap import bound_kernel_caches
    assert sorted(bound_kernel_caches()) == ["LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
import torch

torch.set_num_threads(1)
weight = torch.randn(512, 256)
for rows in range(100, 400):  # 300 shapes, as micro-batches of varying lengths meet them
    torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 256), weight, None, "none", [], "")
print("AGAIN", flush=True)
for rows in range(100, 110):  # the first ten again: kept, or evicted and compiled anew
    torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 256), weight, None, "none", [], "")
"""


def kernels_compiled_again(mode: str) -> int:
    """How many of the first ten shapes oneDNN compiles a second time after 300 others (its log says)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env["ONEDNN_VERBOSE"] = "2"  # a line for every kernel made: create:cache_miss (compiled) or create:cache_hit
    done = subprocess.run([sys.executable, "-c", KERNELS_PROBE, mode], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    if "create:cache_" not in done.stdout:
        pytest.skip("this torch's oneDNN does not log the kernels it makes")
    again = done.stdout.split("AGAIN", 1)[1]
    return again.count("create:cache_miss")


@pytest.mark.run
def test_compiled_kernels_are_bounded_with_the_setting_and_pile_up_without():
    """Each kept kernel holds about 0.6 MB on an AVX-512 CPU; counted, not weighed, as the heap keeps freed pages."""
    import torch

    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        pytest.skip("this torch has no oneDNN CPU products")
    assert kernels_compiled_again("keep") == 0  # oneDNN's default keeps 1,024: all 300 stay
    assert kernels_compiled_again("bound") == 10  # 64 kept: the first ten were evicted long ago


@pytest.mark.unit
def test_the_kernel_caches_are_bounded_unless_the_user_set_them(monkeypatch):
    from rlhf.runtime.run.heap import KERNEL_CACHE_CAPACITY, KERNEL_CACHES, bound_kernel_caches

    for name in KERNEL_CACHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")  # the user's
    assert bound_kernel_caches() == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_CAPACITY) == "64"
    assert os.environ["LRU_CACHE_CAPACITY"] == "8"
    assert bound_kernel_caches() == []  # set once: the second call finds both

