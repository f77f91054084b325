"""What every training loop does around its steps, the same for the RL `Trainer` and the offline
`FitLoop`: the run directory, ``--resume``, lifecycle events, progress, checkpoints, ``final/``,
interrupts and the errors a run ends with.

Interrupts: the first Ctrl-C (SIGINT) or SIGTERM lets the current step finish, writes a
checkpoint and ends the run with `RunInterrupted`, which names the checkpoint and the command
that resumes it. The same signal again abandons the step at once (the latest checkpoint stays
the one to resume from); the other one is taken as part of the same stop, because a launcher
passes a Ctrl-C on to its workers as SIGTERM. Under a launcher every rank gets the signal; the
ranks agree after each step, so they all stop after the same one.

When a run fails, its first error is the one reported: an error raised by an ``on_run_end``
hook while the run is already failing is logged, not raised in its place.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from abc import ABC, abstractmethod
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from rlhf.core.distributed import DistContext
from rlhf.core.errors import RlhfError, RunInterrupted
from rlhf.core.plugin_host.fingerprint import fingerprint_differences, plugin_fingerprint
from rlhf.core.plugin_host.loading import PluginSet
from rlhf.core.types import RunInfo
from rlhf.runtime.run import checkpoint
from rlhf.runtime.run.heap import bound_kernel_caches, return_freed_blocks, threshold_for
from rlhf.runtime.run.model_card import model_card
from rlhf.runtime.run.progress import RL_FIELDS, Progress
from rlhf.runtime.run.run_dir import RunDirectory, cut_logs, log_sizes
from rlhf.runtime.run.run_lock import LOCK_NAME, NoLock, RunLock

log = logging.getLogger(__name__)


class SteppedLoop(ABC):
    """What `run_loop` drives: a training loop implements the abstract calls, and may use the
    others (called in this order: ``begin``, then per step ``run_step``, ``after_step``, and when a
    checkpoint is due ``before_checkpoint``; then ``after_checkpoint``; ``end`` always, last)."""

    run_dir: RunDirectory
    dist: DistContext
    plugins: PluginSet
    total_steps: int
    start_step: int
    fingerprint: dict[str, Any]

    @abstractmethod
    def run_step(self, step: int, run: RunInfo) -> dict[str, float]:
        """One step; its metrics (for ``on_step_end`` and the loggers)."""

    @abstractmethod
    def checkpoint_roles(self) -> dict[str, Any]:
        """What a checkpoint saves: name -> an object with ``save(dir)`` / ``load(dir)``."""

    @abstractmethod
    def trainer_state(self) -> dict[str, Any]:
        """JSON data saved with them."""

    @abstractmethod
    def restore(self, state: dict[str, Any]) -> None:
        """The trainer state of the checkpoint resumed from (its roles are loaded already)."""

    @abstractmethod
    def export_final(self, directory: Path, card: str) -> None:
        """The trained model(s) into ``directory``, on every rank, with ``card`` as its README.md
        (``rlhf.runtime.run.model_card``)."""

    def export_hf(self, directory: Path) -> None:
        """``--save-hf-every``: the trained model(s) into ``directory/hf`` (and the critic, with
        ``--save-critic``, into ``directory/hf_critic``), as `export_final` writes them; on every rank."""
        raise RlhfError(f"--save-hf-every: {type(self).__name__} cannot write Hugging Face exports")

    def begin(self, run: RunInfo) -> None:
        """Before the first step (after ``on_run_start``)."""

    def method(self) -> str | None:
        """What the model is trained with, in a line of Markdown for its model card (None: from the config)."""
        return None

    def after_step(self, done: int, run: RunInfo) -> dict[str, float]:
        """After ``on_step_end`` of step ``done``; metrics to show in the progress line too."""
        return {}

    def before_checkpoint(self, done: int) -> None:
        """A checkpoint of step ``done`` is about to be written."""

    def can_checkpoint(self, done: int) -> bool:
        """Whether a checkpoint after ``done`` steps that a stop asks for (not a scheduled one) can be
        written; when not, the stop leaves the latest checkpoint as it is."""
        return True

    def after_checkpoint(self, done: int) -> None:
        """Step ``done`` is finished, its checkpoint (if one was due) written."""

    def end(self) -> None:
        """The run ends, however it ends (before ``on_run_end``)."""


class StopRequest:
    """The first SIGINT/SIGTERM asks the loop to stop after its step; the second interrupts."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: str | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach only the main thread; elsewhere Ctrl-C keeps its usual meaning
            return
        previous = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested == name:
            raise KeyboardInterrupt(name)
        if self.requested is not None:
            return  # the other signal of the same stop: a launcher (torchrun) passes a Ctrl-C on as SIGTERM
        self.requested = name
        log.warning("%s: finishing this step, then writing a checkpoint (send it again to stop at once)", name)


class PlannedRun(Protocol):
    """What `start_run` needs of a run's plan (the RL `RunPlan` and the offline `FitPlan` both are one)."""

    config: Any  # the run's options: ``threads``, ``resume``, ``resume_override``

    @property
    def out_dir(self) -> Path: ...

    def check(self, *, world_size: int) -> None:
        """Raise `ConfigError` for options that cannot work together on ``world_size`` ranks."""

    def warnings(self) -> list[str]:
        """Options that will do nothing, one sentence each."""

    def run_config(self) -> dict[str, Any]:
        """The run's config as config.yaml records it."""


def start_run(plan: PlannedRun, plugins: PluginSet, *, world_size: int, is_main: bool = True,
              threads: bool = True) -> RunLock | NoLock:
    """The prologue of every run, the same for local, torchrun, fit and the Ray driver, before anything
    is built (for Ray, before it pays for a cluster): the plan's own checks on ``world_size`` ranks;
    the run directory locked for this run (`RunLock`; the caller releases it when the run ends),
    free or resumable with the same options (``--resume-override`` excepted), and writable; a
    warning naming any plugin that failed to load and each of the plan's warnings; this process's
    CPU threads (``threads``: models run in this process; a count fixed by the machine unless
    ``--threads`` says otherwise, the run's own count on ``--resume``); freed memory returned to the
    system (`rlhf.runtime.run.heap`). The builders then seed
    (`seed_everything`) before they draw anything."""
    plan.check(world_size=world_size)
    config = plan.config
    if config.resume and config.threads is None:
        config.threads = recorded_threads(plan.out_dir)
    lock: RunLock | NoLock = NoLock()
    if is_main:
        run_dir = RunDirectory(plan.out_dir)
        if not (plan.out_dir / LOCK_NAME).exists():  # a held lock speaks first; under it the check is made again
            run_dir.check_not_foreign()  # before anything is written there, the lock file included
        lock = RunLock.for_directory(plan.out_dir).acquire()
        try:
            run_dir.check_start(plan.run_config(), resume=config.resume, overrides=config.resume_override,
                                plugins=plugin_fingerprint(plugins)["plugins"])
        except BaseException:
            lock.release()
            raise
        for leftover in run_dir.remove_leftovers():  # a write a kill cut short
            log.info("cleaned up %s, left by a write that did not finish", leftover)
        if plugins.broken:
            log.warning("some plugins failed to load (see `rlhf plugins list`): %s",
                        ", ".join(r.label for r in plugins.broken))
        for warning in plan.warnings():
            log.warning("%s", warning)
    hide_run_data(config, plan.out_dir)
    return_freed_blocks(threshold_for(getattr(config, "model", None)))  # rlhf.runtime.run.heap
    bound_kernel_caches()  # before the first product: oneDNN reads it once (rlhf.runtime.run.heap)
    if threads:
        from rlhf.runtime.run.threads import set_threads

        config.threads = set_threads(config.threads)  # config.yaml records the count the run uses
    return lock


_SYSTEM_DIRS = frozenset({"/", "/usr", "/opt", "/var", "/etc", "/bin", "/lib", "/srv", "/tmp", "/home", "/root"})


def run_data_paths(config: Any, out_dir: Path, cwd: Path | None = None) -> list[str]:
    """What sandboxed code must not read during this run: the ``data`` and ``eval_data`` files,
    the run directory, the files named by ``reward`` (``file.py[:func][@w]``) and ``env``
    references, the project the command runs in (``cwd``, unless it is ``/`` or a system or
    home root) and the datasets cache (`datasets_cache_dir`, unless under /tmp or the home
    directory, which every call hides). Paths that do not exist are left out, but for the run
    directory and the datasets cache, made later."""
    refs = [*(getattr(config, "data", None) or []), *(getattr(config, "eval_data", None) or [])]
    for spec in (*(getattr(config, "reward", None) or []), getattr(config, "env", None) or ""):
        refs.append(str(spec).rpartition("@")[0] or str(spec))
        refs.append(str(spec).partition(":")[0])
    cwd = Path.cwd() if cwd is None else cwd
    if str(cwd.resolve()) not in _SYSTEM_DIRS:
        refs.append(str(cwd))
    found = {str(Path(ref).expanduser().resolve()) for ref in refs if ref and Path(ref).expanduser().exists()}
    made_later = {str(out_dir.resolve())}  # the run directory
    cache = datasets_cache_dir()
    if not any(cache == hidden or cache.startswith(hidden + "/") for hidden in _hidden_by_every_call()):
        made_later.add(cache)  # where `datasets` keeps an arrow copy of --data
    return sorted(found | made_later)


_SANDBOX_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # each call's own, like the home directory


def _hidden_by_every_call() -> list[str]:
    return [*_SANDBOX_TMP, str(Path("~").expanduser().resolve())]


def datasets_cache_dir() -> str:
    """The folder where `datasets` caches what it loads (an arrow copy of every data file): its
    ``HF_DATASETS_CACHE`` once imported, else what it will use (``HF_DATASETS_CACHE``, or
    ``$HF_HOME/datasets``, ``HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface``)."""
    loaded = sys.modules.get("datasets.config")
    if loaded is not None:
        return str(Path(loaded.HF_DATASETS_CACHE).expanduser().resolve())
    cache = os.environ.get("HF_DATASETS_CACHE")
    if not cache:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        cache = os.path.join(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface"), "datasets")
    return str(Path(cache).expanduser().resolve())


def hide_run_data(config: Any, out_dir: Path) -> tuple[str, ...]:
    """Register `run_data_paths` with the sandbox (`rlhf.sandbox.hide_by_default`): model code that
    an environment runs (tool calls, code rewards) cannot print a label from the data file."""
    from rlhf.sandbox import hide_by_default

    hidden = hide_by_default(run_data_paths(config, out_dir))
    log.debug("hidden from sandboxed code: %s", ", ".join(hidden))
    return hidden


def recorded_threads(out_dir: Path) -> int | str | None:
    """The ``threads`` a run's config.yaml records (a count, or auto), None where it records none:
    a ``--resume`` without ``--threads`` uses the count the run began with, so it sums as the run did."""
    import yaml

    try:
        recorded = (yaml.safe_load((out_dir / "config.yaml").read_text()) or {}).get("threads")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return recorded if isinstance(recorded, (int, str)) and not isinstance(recorded, bool) else None


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's random numbers from ``seed``."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_loop(loop: SteppedLoop, *, config: dict[str, Any], resume: bool, save_every: int, keep_checkpoints: int,
             progress: bool, command: str, fields: tuple[tuple[str, str, str], ...] = RL_FIELDS,
             save_hf_every: int = 0) -> Path:
    """Drive ``loop`` from its first (or resumed) step to ``final/``; returns the run directory.
    ``save_hf_every`` N: every N steps the model in HF format too (``checkpoints/step_N/hf``), inside
    the step's checkpoint when one is due, else in a folder of its own (rlhf/runtime/run/checkpoint.py)."""
    run_dir, dist = loop.run_dir, loop.dist
    if resume and _complete(run_dir.path, loop.total_steps):
        if dist.is_main:
            log.warning("%s is complete (step %d of %d, final/ written): --resume has nothing to do; to train "
                        "further: --resume --steps N --resume-override steps", run_dir.path, loop.total_steps,
                        loop.total_steps)
        return run_dir.path
    plugins_record = {"fingerprint": loop.fingerprint,
                      "plugins": [record.to_json() for record in loop.plugins.records if record.loaded]}
    run_dir.prepare(config=config, resume=resume, plugins=plugins_record)
    state = run_dir.resume(loop.checkpoint_roles()) if resume else None
    if state is not None:
        differences = fingerprint_differences(state["fingerprint"], loop.fingerprint)
        if differences and dist.is_main:
            log.warning("resuming with a different plugin set than the checkpoint was written with:\n  %s",
                        "\n  ".join(differences))
        loop.restore(state)
        loop.start_step = state["step"]
    if dist.is_main:
        cut_logs(run_dir.path, state)
    run = RunInfo(config=config, out_dir=run_dir.path, start_step=loop.start_step, total_steps=loop.total_steps,
                  plugins=loop.fingerprint.get("hash", ""), claimer=run_dir.claim if dist.is_main else None)
    bar = Progress(loop.total_steps, loop.start_step, enabled=progress and dist.is_main, fields=fields)
    stop = StopRequest()
    emit = _emitter(loop)
    status, done = "failed", loop.start_step
    last: dict[str, float] = {}  # the last step's metrics and the last eval, for the model card
    try:
        emit("on_run_start", run=run)
        with stop.installed(), startup_objects_frozen():
            loop.begin(run)
            gc.collect()  # start-up's garbage, once, before the steps
            gc.freeze()
            for step in range(loop.start_step, loop.total_steps):
                metrics = loop.run_step(step, run)
                emit("on_step_end", run=run, step=step, metrics=metrics)
                done = step + 1
                last = {**metrics, **loop.after_step(done, run)}
                bar.update(step, last)
                stopping = any(dist.all_gather(stop.requested is not None)) if dist.active else bool(stop.requested)
                hf = loop.export_hf if save_hf_every > 0 and done % save_hf_every == 0 else None
                due = done == loop.total_steps or (save_every > 0 and done % save_every == 0)
                if due or (stopping and loop.can_checkpoint(done)):
                    loop.before_checkpoint(done)
                    saved = {**loop.trainer_state(), "log_sizes": log_sizes(run_dir.path) if dist.is_main else {}}
                    path = run_dir.save_checkpoint(done, loop.checkpoint_roles(), saved, keep=keep_checkpoints, hf=hf)
                    emit("on_checkpoint", run=run, step=done, path=path)
                elif hf is not None:
                    run_dir.save_hf_only(done, hf, keep=keep_checkpoints)
                loop.after_checkpoint(done)
                if stopping and done < loop.total_steps:
                    raise KeyboardInterrupt(stop.requested or "a signal on another rank")
            loop.export_final(run_dir.final, model_card(config, command=command, step=done,
                                                        total_steps=loop.total_steps, metrics=last,
                                                        out=run_dir.final, method=loop.method()))
        status = "completed"
    except KeyboardInterrupt as exc:
        status = "interrupted"
        raise _interrupted(run_dir, command, done, loop.total_steps, str(exc)) from None
    finally:
        try:
            loop.end()
        finally:
            bar.close()
            _end(emit, run, status)
    return run_dir.path


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """Python's cyclic garbage collector leaves the objects made before the first step alone (the
    libraries, the models: about half a million on a small run) until the run ends: `run_loop` collects
    once and freezes them (``gc.freeze``), so the collector's occasional full passes during training
    scan only what the steps made. Before, the first full pass came in the second step and cost a
    0.15 s step 0.2 s more (benchmarks/README.md). Objects freed by their reference counts are
    freed as before; only cycles among start-up objects wait for the run's end."""
    frozen = gc.get_freeze_count() > 0  # a caller's own freeze is left as it was
    try:
        yield
    finally:
        if not frozen:
            gc.unfreeze()


def _complete(path: Path, total_steps: int) -> bool:
    """The run in ``path`` trained all ``total_steps`` (its newest checkpoint) and wrote ``final/``."""
    newest = checkpoint.latest_checkpoint(path)
    if newest is None or not (path / "final").is_dir():
        return False
    return int(newest.name.rpartition("_")[2]) >= total_steps


def _emitter(loop: SteppedLoop) -> Any:
    def emit(event: str, **kwargs: Any) -> None:
        if loop.dist.is_main:
            loop.plugins.emit(event, **kwargs)

    return emit


def _end(emit: Any, run: RunInfo, status: str) -> None:
    """``on_run_end``; when the run already failed, an error here is logged so the first one is reported."""
    if status == "completed":
        emit("on_run_end", run=run, status=status)
        return
    try:
        emit("on_run_end", run=run, status=status)
    except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
        log.error("on_run_end also failed (after the error below): %s", exc)


def _interrupted(run_dir: RunDirectory, command: str, done: int, total: int, why: str) -> RunInterrupted:
    latest = checkpoint.latest_checkpoint(run_dir.path)
    where = (f"the latest checkpoint is {latest} (step {latest.name.removeprefix('step_')})" if latest is not None
             else "no checkpoint was written")
    resume = f"rlhf {command} --config {run_dir.path / 'config.yaml'} --resume"
    return RunInterrupted(f"interrupted ({why or 'Ctrl-C'}) after step {done}/{total}; {where}. "
                          f"Resume with: {resume}")
