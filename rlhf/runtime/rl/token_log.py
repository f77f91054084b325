"""``tokens.jsonl``: what each completion token of a few samples per step was, for ``rlhf view`` (docs/runs.md).

For the first ``--log-tokens N`` trajectories of a step (the first rows of that step in
samples.jsonl; ``sample`` is the row's place among them), one JSON line, written by the trainer
once the step's experience is made, all of a step's lines in one write (a failed write is cut
off the file again, as the loggers do). Per completion token (from the prompt's end on, tool
and environment turns included), columns of equal length:

    ids, pieces        the token id and its text (the tokenizer's decode of that one id)
    mask               1 where the policy sampled it and it trains, 0 for tool / environment text
    logprobs           the policy's log-prob before the update: the step's old log-probs where it
                       computed them, else the update's own forwards' where it could keep them
                       (`rlhf.runtime.rl.workers.PolicyWorker.keep_logprobs`), else computed here for
                       the logged rows (`policy_logprobs`: only where the trainer is given the
                       policy, whole in its process)
    rollout_logprobs   what the rollout engine reported (0 off the mask): the batch's where the
                       policy loss reads them, else the trajectory's own (the trainer asks the
                       engine for them whenever tokens.jsonl is written)
    advantages, kl     the advantage and the KL to the reference the update used (KL: when used)
    origins, versions  [value, count] runs: where each token came from (--agent: template, tool,
                       user, model, ...; else model or env) and the policy version that sampled it
                       (--partial-rollouts and --agent; -1 off the mask)

A missing column was not computed by that run. Floats keep 4 decimals (about 50 bytes a token).
The file is one of the run's logs (``run.claim(..., log=True)``): ``--resume`` cuts it back to
its length at the checkpoint, like metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.core.errors import RlhfError, no_space, says_no_space, size_text
from rlhf.runtime.rl.offpolicy.schedule import runs

if TYPE_CHECKING:
    import torch

    from rlhf.core.batch import ExperienceBatch
    from rlhf.core.protocols.roles import PolicyRole
    from rlhf.core.types import RunInfo, Trajectory

TOKENS_LOG = "tokens.jsonl"


def expand(pairs: list[list[Any]]) -> list[Any]:
    """The inverse of `runs` (`rlhf.runtime.rl.offpolicy.schedule`)."""
    return [value for value, count in pairs for _ in range(int(count))]


def _number(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


def _column(tensor: torch.Tensor | None, row: int, start: int, stop: int) -> list[float | None] | None:
    """Action positions ``start:stop`` of ``row`` as rounded floats; None where the step has no such tensor."""
    if tensor is None:
        return None
    return [_number(v) for v in tensor[row, start:stop].detach().float().cpu().tolist()]


def token_record(trajectory: Trajectory, batch: ExperienceBatch, row: int, *, step: int, sample: int,
                 decode: Any, policy_logprobs: torch.Tensor | None = None) -> dict[str, Any]:
    """The line of one trajectory (row ``row`` of ``batch``); ``step`` counts completed steps (as samples.jsonl).
    ``policy_logprobs``: (N, A') the policy's log-probs of the batch's first N rows, where the batch
    has no old log-probs (`policy_logprobs`)."""
    start = trajectory.prompt_length
    ids = list(trajectory.token_ids[start:])
    mask = list(trajectory.loss_mask[start:])
    # token j is predicted at action position j - 1 (the batch's columns are one shorter than its tokens)
    first, last = start - 1, start - 1 + len(ids)
    record: dict[str, Any] = {"step": step, "sample": sample, "group": trajectory.group, "ids": ids,
                              "pieces": decode(ids), "mask": mask}
    old = batch.old_logprobs if batch.old_logprobs is not None else policy_logprobs
    for name, tensor in (("logprobs", old), ("rollout_logprobs", batch.rollout_logprobs),
                         ("advantages", batch.advantages), ("kl", batch.kl)):
        column = _column(tensor, row, first, last)
        if column is None and name == "rollout_logprobs" and trajectory.rollout_logprobs is not None:
            column = [_number(v) for v in trajectory.rollout_logprobs[start:]]  # per token, as ids
        if column is not None:
            record[name] = column + [None] * (len(ids) - len(column))  # a batch trimmed short of this row
    origins = trajectory.info.get("agent_token_origins")
    record["origins"] = (runs(expand(origins)[start:]) if origins
                         else runs(["model" if m else "env" for m in mask]))
    if trajectory.token_versions is not None:
        record["versions"] = runs(list(trajectory.token_versions[start:]))
    return record


def policy_logprobs(policy: PolicyRole, batch: ExperienceBatch, rows: int) -> torch.Tensor | None:
    """(rows, A') the policy's log-probs of the batch's first ``rows`` rows, computed as the old
    log-probs are (`PolicyRole.logprobs`: eval mode, no gradients, the sampling temperature), where
    the step computed none (else None: the batch's own are logged). Training does not see them: the
    forward draws no random numbers and leaves the model's mode as it was."""
    if batch.old_logprobs is not None:
        return None
    return policy.logprobs(batch.select(list(range(rows))))  # (rows, A')


class TokenLog:
    """Appends each step's records to ``<out>/tokens.jsonl`` (main rank; ``limit`` 0 writes nothing)."""

    def __init__(self, limit: int, tokenizer: Any, enabled: bool = True):
        self.limit, self.tokenizer, self.enabled = limit, tokenizer, enabled and limit > 0
        self._handle: Any = None
        self._path: Path | None = None

    def decode(self, ids: list[int]) -> list[str]:
        return list(self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False))

    def write(self, run: RunInfo, step: int, trajectories: list[Trajectory], batch: ExperienceBatch,
              policy: PolicyRole | None = None, kept: dict[int, torch.Tensor] | None = None) -> None:
        """The records of step ``step`` (0-based) in one write. ``policy``: the policy, whole in this
        process, to compute the logged rows' log-probs where the batch has none (None: not here);
        ``kept``: instead, those log-probs (A,) per row as the update's forwards computed them before
        its optimizer step (`rlhf.runtime.rl.workers.PolicyWorker.keep_logprobs`)."""
        if not self.enabled or not trajectories:
            return
        logged = trajectories[: self.limit]
        computed = policy_logprobs(policy, batch, len(logged)) if policy is not None else None
        if kept is not None and all(row in kept for row in range(len(logged))):
            import torch

            computed = torch.zeros((len(logged), batch.action_mask.shape[1]), dtype=torch.float32)  # (rows, A')
            for row in range(len(logged)):  # a micro-batch's columns are the batch's first (its padding trimmed)
                computed[row, : kept[row].shape[0]] = kept[row]
        lines = [json.dumps(token_record(t, batch, row, step=step + 1, sample=row, decode=self.decode,
                                         policy_logprobs=computed)) + "\n"
                 for row, t in enumerate(logged)]
        data = "".join(lines).encode()
        if self._handle is None:
            self._path = run.claim(TOKENS_LOG, log=True)  # the run's log: cut back on --resume
            self._handle = open(self._path, "ab", buffering=0)
        start = self._handle.tell()
        try:
            if self._handle.write(data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._handle.truncate(start)
            if says_no_space(exc):
                raise no_space(self._path, needed=size_text(len(data))) from exc
            raise RlhfError(f"cannot write {self._path}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
