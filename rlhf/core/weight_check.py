"""Verified weight syncs: exact checksums of tensors, and a deadline that turns a hung sync into one line.

After every sync to an engine that holds weights of its own (the ``vllm`` engine, the Ray rollout
actors' copies), the receiving side proves it holds what was sent (``--verify-weight-sync``, on
by default; docs/vllm.md and docs/architecture.md say where each runtime checks).

**The checksum** (`checksum`) of a tensor is computed on its raw bits, so it is exact: each element's
bits are read as one integer ``w`` (a 4-byte element as int32, a 2-byte one as int16, a 1-byte one
as uint8; an 8-byte element as two int32 words) and, modulo 2**32,

    s1 = Σ w,    s2 = Σ w²,    s3 = Σ w · (i mod 65521 + 1)     (s3 with ``positional=True``; i: the index)

Two tensors with the same bits have the same checksum, on any device, in any summation order
(sums modulo 2**32 do not depend on it). A tensor that differs in one element differs in s1 (w
changes by less than 2**32); a stale or partly updated tensor passes only if its bit deltas and
the deltas of their squares both sum to 0 modulo 2**32. ``s1`` and ``s2`` do not depend on where
an element lies, so they add up over pieces (`add`): the checksum of a concatenation (vLLM's
fused q/k/v, an expert's slice of a fused expert tensor) is the sum of its parts', and zero
padding (vLLM's padded vocabulary) adds nothing. The price: a permutation of a tensor's elements
is not seen without ``s3``, which a receiver holding the sender's layout (the Ray actors) adds.
The tolerance is zero: equal or not.

Cost: two or three int32 passes per element, in chunks of `CHUNK` elements that stay in the CPU's
cache; measured in benchmarks/README.md ("Weight-sync verification").

**The deadline** (`sync_deadline`): a sync that has not ended after ``timeout_s`` raises
`WeightSyncTimeout` in the thread that runs it (at its next Python instruction); one that is stuck
inside a C call (a collective whose peer is gone) cannot be interrupted, so after a further
`GRACE_S` the process prints the one line and exits with status 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from rlhf.core.errors import RlhfError

CHUNK = 65521 * 16  # elements checksummed at a time (4 MiB of int32): a multiple of the modulus
GRACE_S = 30.0  # after the deadline, how long a sync stuck in a C call gets before the process exits
_MODULUS = 65521  # the largest prime below 2**16: positional weights 1 .. 65521
_MOD = 2**32

Checksum = tuple[int, ...]


class WeightSyncError(RlhfError):
    """The engine does not hold what the policy sent (a tensor lost, stale or corrupted on the way)."""


class WeightSyncTimeout(WeightSyncError):
    """A weight sync did not end within --weight-sync-timeout-s."""


def checksum(tensor: Any, *, positional: bool = False) -> Checksum:
    """``(s1, s2)`` (``positional``: ``(s1, s2, s3)``) of ``tensor``'s bits; see the module docstring."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)  # (N,)
    size = flat.element_size()
    words = flat.view({1: torch.uint8, 2: torch.int16}.get(size, torch.int32))  # (W,) one word per element, or 2
    s1 = s2 = s3 = 0
    with torch.no_grad():
        for start in range(0, words.numel(), CHUNK):
            w = words[start:start + CHUNK]  # (C,)
            w = w if w.dtype == torch.int32 else w.to(torch.int32)  # sums and products wrap modulo 2**32
            s1 += int(w.sum(dtype=torch.int32))
            s2 += int((w * w).sum(dtype=torch.int32))
            if positional:
                s3 += int((w * _position_weights(w.device)[:w.numel()]).sum(dtype=torch.int32))
    sums = (s1 % _MOD, s2 % _MOD, s3 % _MOD)
    return sums if positional else sums[:2]


_WEIGHTS: dict[Any, Any] = {}


def _position_weights(device: Any) -> Any:
    """``i mod 65521 + 1`` for i < CHUNK, (CHUNK,) int32 on ``device``; the same for every chunk (CHUNK is
    a multiple of the modulus), made once per device."""
    import torch

    key = (str(device), CHUNK)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.arange(CHUNK, dtype=torch.int32, device=device) % _MODULUS + 1
    return _WEIGHTS[key]


def add(*sums: Checksum) -> Checksum:
    """The checksum of the concatenation of tensors with these (order-free) checksums."""
    return tuple(sum(parts) % _MOD for parts in zip(*sums)) if sums else (0, 0)


def first_mismatch(sent: Mapping[str, Checksum], held: Mapping[str, Checksum | None]) -> str | None:
    """The first name of ``sent`` whose checksum ``held`` lacks or differs in, as one phrase; None if all agree."""
    for name, expected in sent.items():
        got = held.get(name)
        if got is None:
            return f"{name} was sent but did not reach the engine's weights"
        if tuple(got) != tuple(expected):
            return f"{name} holds other values than were sent (checksum {_short(got)}, sent {_short(expected)})"
    return None


def mismatch_error(where: str, problem: str, count: int = 1) -> WeightSyncError:
    """The one-line error of a sync to ``where`` whose first problem is ``problem`` (of ``count`` tensors)."""
    more = f" (and {count - 1} more tensor(s))" if count > 1 else ""
    return WeightSyncError(f"weight sync to {where} failed verification: {problem}{more}; the engine would sample "
                           "from weights the policy does not have, so the run stopped (--no-verify-weight-sync "
                           "turns the check off)")


def _short(value: Checksum) -> str:
    return "/".join(f"{v:x}"[-8:] for v in value)


@contextlib.contextmanager
def sync_deadline(timeout_s: float | None, what: str) -> Iterator[None]:
    """Raise `WeightSyncTimeout` in this thread if the block runs longer than ``timeout_s`` (None or
    <= 0: no deadline); exit the process with the same line if it is still stuck `GRACE_S` later."""
    if not timeout_s or timeout_s <= 0:
        yield
        return
    message = (f"{what} did not finish within {timeout_s:g} s (--weight-sync-timeout-s); the engine may hold a "
               "half-loaded model, so the run stopped. Raise --weight-sync-timeout-s if the sync is just slow")
    timeout = type("WeightSyncTimeout", (WeightSyncTimeout,), {"__init__": _with_message(message)})
    target = threading.get_ident()
    done, lock, fired = threading.Event(), threading.Lock(), []

    def watch() -> None:
        if done.wait(timeout_s):
            return
        with lock:
            if done.is_set():
                return
            fired.append(True)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(timeout))
        if done.wait(GRACE_S):
            return
        sys.stderr.write(f"Error: {message}\n")  # stuck in a C call: nothing else can end it
        sys.stderr.flush()
        os._exit(1)

    watcher = threading.Thread(target=watch, name="rlhf-weight-sync-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with lock:
            done.set()
            if fired:  # posted but maybe not delivered yet: take it back and raise it here, never later
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), None)
        if fired:
            raise timeout()


def _with_message(message: str) -> Any:
    def __init__(self: Exception, *args: Any) -> None:
        Exception.__init__(self, *(args or (message,)))

    return __init__
