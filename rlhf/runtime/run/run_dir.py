"""The run directory (docs/runs.md): what a run writes, and how it continues.

    <out>/config.yaml        the resolved config (rerun it with --config)
    <out>/config.until_step_N.yaml   the config a resumed run replaced (it ran up to step N)
    <out>/plugins.json       the plugin set and its fingerprint
    <out>/metrics.jsonl, samples.jsonl, tensorboard/   (written by the logger plugins)
    <out>/checkpoints/step_N/                          (checkpoint.py: atomic, rotated)
    <out>/checkpoints/step_N/hf/, hf_critic/           with --save-hf-every: the model as final/ is written
    <out>/final/             the trained policy (the model adapter's layout; written like a checkpoint)
    <out>/best/              with --save-best: the policy that scored best on the eval, and best.json

A run owns its files, and only those (`rlhf.runtime.run.run_files`): ``<out>/.rlhf-run.json``
records every name the run writes there, and resume and clean-up touch nothing else, so a file a
user puts beside a run survives it. An ``--out`` that is not empty and holds no run is refused
before anything is written. A directory "holds a run" once a step completed (a row in
metrics.jsonl, a checkpoint or ``final/``): the files a run writes as it starts (config.yaml,
plugins.json) do not make one, so a run that failed at start can simply be rerun.

``--resume`` continues from the latest complete checkpoint with the options the run was started
with: an option that changes what the run trains (see `RESUME_FREE` for those that do not) is
refused unless ``--resume-override`` names it.

Every rank of a data-parallel run holds a `RunDirectory`; only the main rank writes files of its
own, while checkpoints are written by every rank (sharded state) and finished by the main rank.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf.core.distributed import SINGLE, DistContext
from rlhf.core.errors import NO_SPACE_ERRNOS, ConfigError, RlhfError, no_space, size_text
from rlhf.runtime.config.identity import (OVERRIDE_DATA, OVERRIDE_PLUGINS, describe_cursor, flatten,
                                          identity_changes, run_identity, with_cursor)
from rlhf.runtime.run import checkpoint
from rlhf.runtime.run.model_card import export_notes
from rlhf.runtime.run.export import inner_models
from rlhf.runtime.run.run_files import RUN_MANIFEST, TRAINING, RunFiles, check_not_foreign, entries

log = logging.getLogger(__name__)

# Options a resumed run may change freely (how it reports, saves and runs; not what it trains).
INVOCATION_ONLY = ("resume", "resume_override")  # options config.yaml does not record (`RunDir.prepare`)
RESUME_FREE = frozenset({"resume", "resume_override", "out", "progress", "save_every", "keep_checkpoints",
                         "save_hf_every", "threads",
                         "tensorboard", "wandb_project", "wandb_group", "wandb_run_name", "log_samples",
                         "log_tokens",
                         "ray_address", "ray_place", "device",
                         "verify_weight_sync", "weight_sync_timeout_s"})
# The names the host writes, recorded as the run's when it starts (logs are recorded as they are opened).
HOST_NAMES = ("config.yaml", "plugins.json", "checkpoints", "final", "best", "critic")
# What a run writes before its first step completes: a run that failed at start holds no run yet.
_START_FILES = frozenset({"config.yaml", "plugins.json", "metrics.jsonl", "samples.jsonl", "tokens.jsonl", "tensorboard",
                          "checkpoints",
                          RUN_MANIFEST})


class RunDirectory:
    def __init__(self, path: Path, dist: DistContext = SINGLE):
        self.path, self.dist = Path(path), dist
        self._files: RunFiles | None = None  # the run manifest, once `prepare` opened it (main rank)
        self.identity: dict[str, Any] | None = None  # what each checkpoint records of the run (`prepare`, main rank)

    @property
    def final(self) -> Path:
        return self.path / "final"

    # --- before anything is built ---------------------------------------------------------------

    def holds_run(self) -> bool:
        """True once a step completed here (see the module docstring); files that are not the run's do not count."""
        files = RunFiles.read(self.path, TRAINING)
        if files is None:
            return False
        others = {name for name in entries(self.path) if files.owns(name)} - _START_FILES
        return (bool(others) or bool(checkpoint.list_checkpoints(self.path))
                or _has_step_rows(self.path / "metrics.jsonl"))

    def check_not_foreign(self) -> None:
        """Refuse an ``--out`` that is not empty and holds no run (exit 2; reads only)."""
        check_not_foreign(self.path, TRAINING)

    def check_free(self, *, resume: bool) -> None:
        """Refuse an ``--out`` of other files, and a new run over an existing one (before anything is built)."""
        self.check_not_foreign()
        if not resume and self.holds_run():
            raise ConfigError(f"{self.path} already holds a run: pass --resume to continue it, or choose another "
                              "--out")

    def check_start(self, config: dict[str, Any], *, resume: bool, overrides: list[str],
                    plugins: dict[str, str] | None = None) -> None:
        """`check_free`, the directory writable, and on ``--resume`` the options compared with the
        run's: changes outside `RESUME_FREE` need ``--resume-override``, the rest are reported; then the
        identity the newest checkpoint recorded (`check_identity`: options, ``plugins`` versions, data files)."""
        self.check_free(resume=resume)
        self._writable()
        saved = self.path / "config.yaml"
        if not resume or not saved.is_file() or checkpoint.latest_checkpoint(self.path) is None:
            return
        import yaml

        before = _flatten(yaml.safe_load(saved.read_text()) or {})
        now = _flatten(config)
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k) and k not in RESUME_FREE)
        unknown = sorted(set(overrides) - set(before) - set(now) - {OVERRIDE_PLUGINS, OVERRIDE_DATA})
        if unknown:
            from rlhf.core.errors import close_matches

            names = sorted((set(before) | set(now) | {OVERRIDE_PLUGINS, OVERRIDE_DATA}) - RESUME_FREE)
            hint = close_matches(unknown[0], names, n=1)
            raise ConfigError(f"--resume-override {', '.join(unknown)}: no such option (names are config keys like lr, "
                              "steps or backend.zero_stage, or plugins, or data)"
                              + (f"; did you mean {hint[0]}?" if hint else ""))
        refused = [k for k in changed if k not in overrides]
        if refused:
            lines = "; ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in refused)
            raise ConfigError(f"--resume with options that change what {self.path} trains ({lines}). Resume with the "
                              f"run's options (they are in {saved}), or pass --resume-override "
                              f"{' '.join(refused)} to change them from here on")
        for key in sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k) and k in RESUME_FREE
                          and k not in ("resume", "resume_override", "out")):
            log.warning("--resume: %s changed from %r to %r", key, before.get(key), now.get(key))
        for key in changed:
            log.warning("--resume: %s changed from %r to %r (--resume-override)", key, before.get(key), now.get(key))
        if plugins is not None:
            self.check_identity(run_identity(config, plugins, RESUME_FREE), overrides, reported=set(changed))

    def check_identity(self, now: dict[str, Any], overrides: list[str], reported: set[str] = frozenset()) -> None:
        """Compare the run identity ``now`` with the one the newest checkpoint with a readable manifest
        recorded: what changed (an option, a plugin's version, a data file's content) is refused in one
        line unless ``overrides`` names it (an option's key, ``plugins``, ``data``), and what it names is
        reported (but the options in ``reported``); a checkpoint from before identities were recorded
        is resumed with one warning."""
        for folder in reversed(checkpoint.list_checkpoints(self.path)):
            readable, recorded = checkpoint.recorded_identity(folder)
            if readable:
                break
        else:
            return
        where = folder.relative_to(self.path)
        if recorded is None:
            log.warning("--resume: %s was written before checkpoints recorded the run's configuration, plugins and "
                        "data; they are not checked against it", where)
            return
        changes = identity_changes(recorded, now)
        refused = {name: what for name, what in changes.items() if name not in overrides}
        if refused:
            what = "; ".join(line for lines in refused.values() for line in lines)
            raise ConfigError(f"--resume: {where} was written with other {_kinds(refused)} ({what}; the data cursor "
                              f"stood at {describe_cursor(recorded.get('cursor'))}). Resume with what the run "
                              f"trained on, or pass --resume-override {' '.join(refused)} to continue with this")
        for name, lines in changes.items():
            for line in lines if name not in reported else ():  # an option config.yaml's comparison named already
                log.warning("--resume: %s (--resume-override %s)", line, name)

    def _writable(self) -> None:
        """Write a probe file there; folders made for it are removed again (a run that stops before its
        first write leaves no empty --out behind)."""
        probe = self.path / f".write-test-{os.getpid()}"
        made = [p for p in (self.path, *self.path.parents) if not p.exists()]  # innermost first
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
            for folder in made:
                folder.rmdir()
        except OSError as exc:
            raise ConfigError(f"--out {self.path}: cannot write there ({exc.strerror or exc}); choose another "
                              "--out") from None

    # --- the run ---------------------------------------------------------------------------------

    def prepare(self, *, config: dict[str, Any], plugins: dict[str, Any], resume: bool) -> None:
        """Create the directory and write config.yaml and plugins.json (main rank; every rank waits).
        On ``--resume`` a config.yaml that differs is kept as ``config.until_step_N.yaml``. The run's
        identity (``plugins["fingerprint"]``: the plugin versions) is what each checkpoint records.
        ``resume`` and ``resume_override`` say how this process started, not what the run is: they are
        left out, so config.yaml is reusable as a fresh run's ``--config`` and a plain resume leaves
        it as it was."""
        config = {k: v for k, v in config.items() if k not in INVOCATION_ONLY}
        if self.dist.is_main:
            import yaml

            self.identity = run_identity(config, plugins.get("fingerprint", {}).get("plugins", {}), RESUME_FREE)
            self.check_free(resume=resume)
            self._files = RunFiles.open(self.path, TRAINING)
            self._files.claim(*HOST_NAMES)
            text = yaml.safe_dump(config, sort_keys=False)
            saved = self.path / "config.yaml"
            latest = checkpoint.latest_checkpoint(self.path)
            if resume and saved.is_file() and latest is not None and saved.read_text() != text:
                until = f"config.until_{latest.name}.yaml"
                self._files.claim(until)
                os.replace(saved, self.path / until)
            write_text(saved, text)
            write_text(self.path / "plugins.json", json.dumps(plugins, indent=2))
        self.dist.barrier()

    def claim(self, name: str, log: bool = False) -> None:
        """Record ``name`` (at the top of the run directory) as the run's before it is written; ``log``:
        a JSON-lines log, cut back on ``--resume`` (`cut_logs`). What ``RunInfo.claim`` calls (main rank)."""
        if self._files is None:
            self._files = RunFiles.open(self.path, TRAINING)
        self._files.claim(name, log=log)

    def remove_leftovers(self) -> list[Path]:
        """What killed writes of the run left (call only while holding the run's lock): hidden
        ``.<name>.tmp`` / ``.<name>.old`` entries of names the run owns, here and in ``checkpoints/``
        (an ``.old`` whose ``name`` is missing is put back). Nothing that is not the run's is touched."""
        files = RunFiles.read(self.path, TRAINING)
        if files is None:
            return []
        return checkpoint.clean_leftovers(self.path, files.owns) + checkpoint.remove_leftovers(self.path)

    def write_model(self, directory: Path, export: Callable[[Path], None], *,
                    record: dict[str, Any] | None = None, card: str | None = None) -> Path:
        """``export(tmp)`` on every rank into a folder beside ``directory``, then (main rank) the JSON
        files of ``record`` ({file name: data}) and the model card (README.md, with `export_notes`)
        added, and the folder fsynced and renamed into place as a checkpoint is
        (`checkpoint.write_directory`): a reader, or a kill, never meets a half-written model."""
        def write(tmp: Path) -> None:
            export(tmp)
            if self.dist.is_main:
                for name, data in (record or {}).items():
                    (tmp / name).write_text(json.dumps(data, indent=2))
                for model in (tmp, *inner_models(tmp)) if card is not None else ():  # inner: e.g. a merged copy
                    (model / "README.md").write_text(card + export_notes(model))

        return checkpoint.write_directory(directory, write, self.dist)

    def save_checkpoint(self, step: int, roles: dict[str, Any], state: dict[str, Any], *, keep: int,
                        hf: Callable[[Path], None] | None = None) -> Path:
        """``checkpoints/step_<step>``: each role's state, every rank's RNG and the trainer's ``state``
        (and the HF exports ``hf(folder)`` writes, with ``--save-hf-every``)."""
        run = with_cursor(self.identity, {"step": step, **state}) if self.identity is not None else None
        return checkpoint.save_checkpoint(self.path, step, workers=roles, trainer_state=state, keep=keep,
                                          dist=self.dist, hf=hf, run=run)

    def save_hf_only(self, step: int, hf: Callable[[Path], None], *, keep: int) -> Path:
        """``checkpoints/step_<step>`` with the HF exports only (``--save-hf-every`` on a step due no checkpoint)."""
        return checkpoint.save_hf_only(self.path, step, hf, keep=keep, dist=self.dist)

    def resume(self, roles: dict[str, Any]) -> dict[str, Any] | None:
        """Load the newest intact checkpoint into ``roles`` (`checkpoint.intact_checkpoint`: the main rank
        checks the manifests, every rank loads its choice); its trainer state (None: there is none)."""
        choice: tuple[str | None, str | None] = (None, None)  # (checkpoint, error)
        if self.dist.is_main:
            try:
                found = checkpoint.intact_checkpoint(self.path)
                choice = (str(found) if found is not None else None, None)
            except RlhfError as exc:
                choice = (None, str(exc))
        name, error = self.dist.broadcast(choice)
        if error is not None:
            raise RlhfError(error)
        path = Path(name) if name is not None else None
        if path is None:
            if self.dist.is_main:
                log.warning("--resume: no complete checkpoint in %s; starting from step 0", self.path)
            return None
        state = checkpoint.load_checkpoint(path, roles, self.dist)
        if state.get("world_size", 1) != self.dist.world_size:
            raise RlhfError(f"{path} was written by {state.get('world_size', 1)} processes; resume it with "
                            f"the same number (this run has {self.dist.world_size})")
        if self.dist.is_main:
            log.warning("resumed from %s (step %d)", path.relative_to(self.path), state["step"])
        return state


def log_sizes(path: Path) -> dict[str, int]:
    """The length of each of the run's logs (saved with every checkpoint)."""
    files = RunFiles.read(path, TRAINING)
    return {file.name: file.stat().st_size for file in files.existing_logs()} if files is not None else {}


def cut_logs(path: Path, state: dict[str, Any] | None) -> None:
    """Cut each of the run's logs (the JSON-lines files its manifest records as logs, `RunFiles`) back
    to what it held when the checkpoint ``state`` was written (``state`` None: the run starts from
    step 0, so to nothing). Rows written after the checkpoint would otherwise appear twice once the
    resumed run logs those steps again. Files that are not the run's are not touched."""
    files = RunFiles.read(path, TRAINING)
    for file in files.existing_logs() if files is not None else []:
        if state is None:
            keep = 0
        elif "log_sizes" in state:
            keep = state["log_sizes"].get(file.name, 0)
        else:  # a checkpoint of an earlier version: keep the rows of steps up to its own
            _cut_to_step(file, state["step"])
            continue
        if file.stat().st_size > keep:
            with open(file, "r+b") as handle:
                handle.truncate(keep)


def _cut_to_step(file: Path, step: int) -> None:
    kept = []
    for line in file.read_bytes().splitlines(keepends=True):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the line a crash cut short
        if line.endswith(b"\n") and isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
    write_text(file, b"".join(kept).decode())


def write_text(path: Path, text: str) -> None:
    """Write a small file whole or not at all (temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in NO_SPACE_ERRNOS:
            raise no_space(path, needed=size_text(len(text.encode()))) from exc
        raise RlhfError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _has_step_rows(path: Path) -> bool:
    """Whether ``metrics.jsonl`` holds a row of a completed step (step >= 1; the eval before the first
    step is row 0, and a run that stopped there, e.g. on a ``--save-best`` typo, is no run yet)."""
    try:
        with open(path, "rb") as handle:
            for line in handle:
                if not line.strip():
                    continue
                try:
                    step = json.loads(line).get("step", 1)
                except (ValueError, AttributeError):
                    return True  # not ours to judge: keep it
                if not isinstance(step, int) or step >= 1:
                    return True
    except OSError:
        return False
    return False


_flatten = flatten  # config.yaml's mapping as flat keys (``backend.zero_stage``)


def _kinds(changes: dict[str, list[str]]) -> str:
    """``options``, ``plugins``, ``data`` or a list of them, for what ``changes`` holds."""
    kinds = [kind for kind, present in (("options", any(k not in (OVERRIDE_PLUGINS, OVERRIDE_DATA) for k in changes)),
                                        ("plugin versions", OVERRIDE_PLUGINS in changes),
                                        ("data", OVERRIDE_DATA in changes)) if present]
    return " and ".join(kinds)

