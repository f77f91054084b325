"""Built-in loggers, as plugins on the lifecycle hooks: metrics.jsonl, samples.jsonl,
TensorBoard (``--tensorboard``) and Weights & Biases (``--wandb-project``).

Each keeps its per-run state in a dict keyed by the run's directory, so several runs in one
process (tests, notebooks) do not mix.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from pathlib import Path
from typing import Any

from rlhf.api import RlhfError, hookimpl, no_space, says_no_space, size_text

_open: dict[tuple[str, Path], Any] = {}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


def _append(run: Any, name: str, record: dict[str, Any]) -> None:
    """One JSON line, whole or not at all: a failed write (a full disk) is cut off the file and
    reported with the file's name."""
    key = (name, Path(run.out_dir))
    path = Path(run.out_dir) / name
    if key not in _open:
        _open[key] = open(run.claim(name, log=True), "ab", buffering=0)  # the run's log: cut back on --resume
    handle = _open[key]
    line = (json.dumps({k: _jsonable(v) for k, v in record.items()}, default=str) + "\n").encode()
    start = handle.tell()
    try:
        written = handle.write(line)
        if written != len(line):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        with contextlib.suppress(OSError):
            handle.truncate(start)
        if says_no_space(exc):
            raise no_space(path, needed=size_text(len(line))) from exc
        raise RlhfError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _close(run: Any) -> None:
    for key in [k for k in _open if k[1] == Path(run.out_dir)]:
        handle = _open.pop(key)
        if hasattr(handle, "close"):
            handle.close()
        elif hasattr(handle, "finish"):
            handle.finish()


@hookimpl
def on_run_start(run):
    out = Path(run.out_dir)
    if run.config.get("tensorboard"):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RlhfError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
        _open[("tensorboard", out)] = SummaryWriter(log_dir=str(run.claim("tensorboard")),
                                                     purge_step=run.start_step)
    if run.config.get("wandb_project"):
        try:
            import wandb
        except ImportError as exc:
            raise RlhfError("--wandb-project needs the wandb package: pip install 'rlhf-core[wandb]'") from exc
        run.claim("wandb")  # the folder wandb writes its files into
        _open[("wandb", out)] = wandb.init(project=run.config["wandb_project"], config=run.config, dir=str(out),
                                           group=run.config.get("wandb_group"),
                                           name=run.config.get("wandb_run_name") or out.name, resume="allow")


@hookimpl
def on_step_end(run, step, metrics):
    _log_row(run, step + 1, metrics)


@hookimpl(trylast=True)
def on_eval(run, step, metrics):
    _log_row(run, step, metrics)


def _log_row(run, step, metrics):
    """One row of metrics.jsonl (``step``: steps completed), and the same to TensorBoard / W&B."""
    _append(run, "metrics.jsonl", {"step": step, **metrics})
    out = Path(run.out_dir)
    writer = _open.get(("tensorboard", out))
    if writer is not None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                writer.add_scalar(key, value, step)
        writer.flush()
    wandb_run = _open.get(("wandb", out))
    if wandb_run is not None:
        wandb_run.log(dict(metrics), step=step)


@hookimpl(trylast=True)
def on_rewards(run, step, trajectories, rewards):
    limit = run.config.get("log_samples")
    for index, trajectory in enumerate(trajectories[:limit] if limit is not None else trajectories):
        _append(run, "samples.jsonl", {
            "step": step + 1, "group": trajectory.group, "prompt": trajectory.prompt_text,
            "completion": trajectory.completion_text, "label": trajectory.label, "reward": float(rewards[index]),
            "rewards": trajectory.rewards, "finish_reason": trajectory.finish_reason,
            "completion_tokens": trajectory.num_policy_tokens, "turns": trajectory.num_turns, "outcome": trajectory.outcome,
            "error": trajectory.error,
            # --agent (docs/agents.md): where each token came from, as [origin, count] runs; the
            # trajectory's other sequences (segments) alike
            **_tokens(trajectory),
            **({"segments": [{"completion": segment.completion_text,
                              "completion_tokens": segment.num_policy_tokens, **_tokens(segment)}
                             for segment in trajectory.segments]} if trajectory.segments else {}),
        })


def _tokens(trajectory):
    """``token_origins`` (--agent: every token's) and ``token_versions`` (--agent, --partial-rollouts: the
    policy version that sampled each completion token, -1 where no policy did; docs/runs.md), as runs."""
    out = {"token_origins": trajectory.info["agent_token_origins"]} if "agent_token_origins" in trajectory.info else {}
    if trajectory.token_versions is not None:
        out["token_versions"] = _runs(trajectory.token_versions[trajectory.prompt_length:])
    return out


def _runs(values):
    """[3, 3, -1] -> [[3, 2], [-1, 1]]."""
    out = []
    for value in values:
        if out and out[-1][0] == value:
            out[-1][1] += 1
        else:
            out.append([value, 1])
    return out


@hookimpl
def on_run_end(run, status):
    _close(run)
