"""The same command gives the same weights however busy the machine: no backward in a training
step sums repeated rows with torch's unordered (atomic, multi-threaded) CPU adds.

torch's plain indexing ``x[index]`` has a backward that, on a CPU, adds the gradients of
repeated rows with atomic float adds spread over the threads (from 32k elements on): the last
bits of the sum then follow the threads' timing. Every trainer's step runs here under a dispatch
mode that records each accumulating ``index_put`` whose index repeats on a CPU tensor (at these
tiny sizes torch still adds them serially; at real sizes it would not), and there must be none.
`rlhf.core.ordered_gather.gather_rows` is the gather to use where an index repeats."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf.core.ordered_gather import gather_rows
from tests.helpers import command_args, run_cli


class UnorderedSums(TorchDispatchMode):
    """Records accumulating ``index_put`` calls with a repeated index on CPU tensors."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.startswith(("index_put", "_index_put_impl")):
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            target, indices = args[0], [index for index in args[1] if index is not None]
            if any(index.dtype == torch.bool for index in indices):  # a mask picks each place once
                indices = list(torch.cat([index.nonzero() if index.dtype == torch.bool else index.reshape(-1, 1)
                                          for index in indices], dim=1).unbind(1))
            if accumulate and target.device.type == "cpu" and indices:
                flat = torch.stack([index.reshape(-1).long() for index in indices]) if len(indices) > 1 \
                    else indices[0].reshape(-1).long()[None]
                if torch.unique(flat, dim=1).shape[1] < flat.shape[1]:
                    self.found.append((tuple(target.shape), flat.shape[1]))
        return func(*args, **kwargs)


def _gradient_digest(kind: str, source: torch.Tensor, index: torch.Tensor, upstream: torch.Tensor) -> str:
    x = source.clone().requires_grad_()
    rows = x[index] if kind == "index" else gather_rows(x, index)
    (rows * upstream).sum().backward()
    return hashlib.sha256(x.grad.numpy().tobytes()).hexdigest()


@pytest.mark.unit
def test_gather_rows_is_indexing_with_an_ordered_backward():
    """Values and gradients as ``x[index]``; with many repeats on two threads, the same bits every
    time (where plain indexing's backward, at this size, differs from try to try)."""
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(64, 1024, generator=generator)  # (N, D)
    index = torch.randint(0, 64, (512,), generator=generator)  # (K,) each row read 8 times on average
    upstream = torch.randn(512, 1024, generator=generator)  # (K, D)
    plain = source.clone().requires_grad_()
    (plain[index] * upstream).sum().backward()
    ordered = source.clone().requires_grad_()
    assert torch.equal(gather_rows(ordered, index), source[index])
    (gather_rows(ordered, index) * upstream).sum().backward()
    torch.testing.assert_close(ordered.grad, plain.grad, rtol=1e-5, atol=1e-5)
    expected = torch.zeros_like(source).index_add_(0, index, upstream)  # the sum, one row after another
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        digests = {_gradient_digest("ordered", source, index, upstream) for _ in range(20)}
    finally:
        torch.set_num_threads(threads)
    assert len(digests) == 1
    torch.testing.assert_close(ordered.grad, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="1-D index"):
        gather_rows(source, index[None])


@pytest.mark.unit
def test_the_detector_sees_plain_indexing_with_repeats():
    source = torch.randn(4, 3, requires_grad=True)
    with UnorderedSums() as seen:
        source[torch.tensor([0, 0, 1])].sum().backward()
        gather_rows(source, torch.tensor([0, 0, 1])).sum().backward()
        source[torch.tensor([0, 1, 2])].sum().backward()  # no repeat: every row written once
        source[torch.tensor([True, False, True, True])].sum().backward()  # a mask never repeats
    assert seen.found == [((4, 3), 3)]


def _train(tiny_model_dir, task, out, plugins, *extra):
    return run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                             "--label-key", "answer", "--reward", str(task / "rewards.py"), "--n-samples", "4",
                             "--prompts-per-step", "2", "--max-new-tokens", "6", "--micro-batch-size", "8",
                             "--steps", "1", "--out", str(out), "--no-progress", "--threads", "2", *extra])


@pytest.mark.run
@pytest.mark.parametrize("path", ["masked", "segment"])
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_an_rl_step_with_shared_prompts_sums_in_order(tiny_model_dir, task, tmp_path, plugins, monkeypatch,
                                                      path, algo):
    """The n samples of a prompt read the logits at its last token n times: the shared forward's
    gathers (the model's own masked forward, or attention per segment) must sum in order."""
    from rlhf.fastpaths import prefix_sharing

    monkeypatch.setattr(prefix_sharing, "segments_pay", lambda layout: path == "segment")
    taken = []
    real = prefix_sharing.sharing_path
    monkeypatch.setattr(prefix_sharing, "sharing_path", lambda model, rows: taken.append(real(model, rows))
                        or taken[-1])
    with UnorderedSums() as seen:
        result = _train(tiny_model_dir, task, tmp_path / "run", plugins, "--algo", algo)
    assert result.exit_code == 0, result.output
    assert f"prefix_sharing/{path}" in taken
    assert seen.found == []


@pytest.mark.run
@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "kto", "prm", "distill"])
def test_an_offline_step_sums_in_order(command, tiny_model_dir, fit_data, fit_teacher, tmp_path, plugins):
    args = command_args(command, tiny_model_dir, fit_data, fit_teacher) + [
        "--batch-size", "4", "--micro-batch-size", "4", "--steps", "1", "--out", str(tmp_path / "run"),
        "--no-progress", "--threads", "2"]
    with UnorderedSums() as seen:
        result = run_cli(plugins, args)
    assert result.exit_code == 0, result.output
    assert seen.found == []
