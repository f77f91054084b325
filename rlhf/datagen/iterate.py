"""``rlhf iterate``: iterative DPO (Online-RLHF's loop, as OpenRLHF's documents describe it).

Round k (1-based), in ``<out>/round_k/``:

1. ``generations.jsonl``: ``rlhf generate`` from the round's starting model (round 1: ``--model``;
   round k: round k-1's DPO model), ``--n`` samples per prompt scored by ``--reward``, seed
   ``--seed + k - 1``; with ``--prompts-per-round`` the round's prompts (taken in order, wrapping
   around) are in ``prompts.jsonl``;
2. ``pairs.jsonl``: the best against the worst sample of each prompt (`rows.make_rows`, mode
   ``pairs``; prompts whose samples tie are skipped and counted);
3. ``dpo/``: ``rlhf dpo`` on the pairs, starting from and referenced to the round's starting model;
   its model is ``dpo/final`` (with LoRA, the merged ``dpo/final/merged``), also reachable as
   ``model`` (a link). ``--objective`` picks another objective that learns from preference pairs
   (one registered with ``preference_strength``, the setting ``--beta`` sets; its run is then in
   ``<objective>/``); a model adapter registered with ``merge_setting`` is asked for a merged
   model, so that the next round starts from full weights;
4. ``round.json`` (written last: the round is complete) and one line of ``<out>/metrics.jsonl``.

One process (not under torchrun). A rerun continues after the last complete round; inside a round,
the generation continues its file and the DPO run resumes from its latest checkpoint
(``--dpo-config save_every=N``). The run owns the names above (``<out>/.rlhf-run.json`` records
them) and nothing else there; an ``--out`` that is not empty and holds no iterate run is refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError, RlhfError
from rlhf.datagen.config import GenerateConfig, IterateConfig
from rlhf.datagen.rows import Sample, Selection, make_rows
from rlhf.runtime.run.run_files import Layout, RunFiles, check_not_foreign
from rlhf.runtime.run.run_lock import LOCK_NAME, RunLock

log = logging.getLogger(__name__)

# What an iterate run writes at the top of its --out (and one from before run manifests owns).
ITERATION = Layout(kind="iteration", marks=(r"config\.yaml", r"round_\d+"),
                   legacy=(r"config\.yaml", r"metrics\.jsonl", r"round_\d+"))

# IterateConfig fields that GenerateConfig shares (the rest are the loop's or DPO's).
_DPO_ONLY = ("rounds", "prompts_per_round", "objective", "beta", "lr", "epochs", "dpo_batch_size", "micro_batch_size",
             "max_len", "dpo_config", "out", "progress")


def iterate(config: IterateConfig, *, plugins: Any = None) -> Path:
    """Run every round not yet complete; returns the run directory."""
    from rlhf.core.distributed import launched_with_ranks
    from rlhf.core.plugin_host.loading import build_plugin_manager

    config.check()
    if launched_with_ranks():
        raise RlhfError("rlhf iterate runs in one process: start it without torchrun (rlhf generate and rlhf dpo "
                        "each run data-parallel under torchrun on their own)")
    plugins = plugins or build_plugin_manager()
    check_dpo_options(config, plugins)
    out = Path(config.out)
    if not (out / LOCK_NAME).exists():
        check_not_foreign(out, ITERATION)  # before anything is written there
    with RunLock.for_directory(out):  # one iterate per run directory
        check_not_foreign(out, ITERATION)
        files = RunFiles.open(out, ITERATION)  # what the run owns there (rlhf.runtime.run.run_files)
        files.claim("config.yaml", "metrics.jsonl")
        _write_config(out, config)
        model = config.model
        for k in range(1, config.rounds + 1):
            round_dir = out / f"round_{k}"
            marker = round_dir / "round.json"
            if marker.exists():
                model = json.loads(marker.read_text())["model"]
                log.info("round %d is complete (model %s)", k, model)
                continue
            files.claim(round_dir.name)
            model = run_round(config, k, model, round_dir, plugins)
    return out


def run_round(config: IterateConfig, k: int, start: str, round_dir: Path, plugins: Any) -> str:
    """One round from the model ``start``; returns its DPO model's directory."""
    from rlhf.datagen.generate import generate

    round_dir.mkdir(parents=True, exist_ok=True)
    data = _round_prompts(config, k, round_dir)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(IterateConfig) if f.name not in _DPO_ONLY}
    gen = GenerateConfig(**{**values, "model": start, "data": data, "seed": config.seed + k - 1,
                            "out": str(round_dir / "generations.jsonl"), "progress": config.progress})
    if data != list(config.data):
        gen = dataclasses.replace(gen, data_probs=None, max_samples=None)
    generate(gen, plugins=plugins)
    metrics = _write_pairs(round_dir / "generations.jsonl", round_dir / "pairs.jsonl")
    if not metrics["pairs"]:
        raise RlhfError(f"round {k}: the samples of every prompt tie, so there are no pairs to train on; use more "
                        "--n, a higher --temperature or a finer-grained --reward")
    objective = _objective(config, plugins)
    final = _dpo(config, objective, start, round_dir / "pairs.jsonl", round_dir / objective.name, plugins)
    link = round_dir / "model"
    if not link.is_symlink():
        link.symlink_to(final.relative_to(round_dir), target_is_directory=True)
    metrics.update({f"{objective.name}/{key}": value
                    for key, value in _last_metrics(round_dir / objective.name).items()})
    final = final.resolve()  # the next round's --model, the same in a fresh and in a resumed run
    record = {"round": k, "start_model": start, "model": str(final), **metrics}
    _atomic_write(round_dir / "round.json", json.dumps(record, indent=2))
    records = [json.loads((Path(config.out) / f"round_{i}" / "round.json").read_text()) for i in range(1, k + 1)]
    _atomic_write(Path(config.out) / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    log.info("round %d: %s", k, ", ".join(f"{key} {value}" for key, value in metrics.items()))
    return str(final)


def _round_prompts(config: IterateConfig, k: int, round_dir: Path) -> list[str]:
    """The round's prompt files: every --data, or this round's slice of them in prompts.jsonl."""
    if config.prompts_per_round is None:
        return list(config.data)
    path = round_dir / "prompts.jsonl"
    if not path.exists():
        from rlhf.datagen.components import data_settings
        from rlhf.runtime.run.data import load_prompts, row_values

        dataset = load_prompts(data_settings(config))
        begin = (k - 1) * config.prompts_per_round
        rows = [row_values(dataset[(begin + i) % len(dataset)]) for i in range(config.prompts_per_round)]
        _atomic_write(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return [str(path)]


def _write_pairs(generations: Path, pairs: Path) -> dict[str, float]:
    """Best vs worst sample of each prompt of ``generations`` into ``pairs``; the round's reward metrics."""
    skipped: Counter = Counter()
    rows, rewards, chosen, rejected = [], [], [], []
    for line in generations.read_text().splitlines():
        row = json.loads(line)
        rewards += [r for r in row["rewards"] if r is not None]
        for pair in make_rows(Sample(prompt=row["prompt"], completions=row["completions"], rewards=row["rewards"]),
                              Selection(mode="pairs"), skipped):
            rows.append(pair)
            chosen.append(pair["chosen_reward"])
            rejected.append(pair["rejected_reward"])
    _atomic_write(pairs, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    mean = lambda values: sum(values) / len(values) if values else float("nan")  # noqa: E731
    return {"reward/mean": mean(rewards), "reward/chosen_mean": mean(chosen), "reward/rejected_mean": mean(rejected),
            "pairs": len(rows), "skipped/ties": skipped["ties"], "skipped/unscored": skipped["unscored"]}


def _objective(config: IterateConfig, plugins: Any) -> Any:
    """The registered objective the rounds train with (``--objective``, or ``objective=`` in
    ``--dpo-config``): one that learns from preference pairs, declaring ``preference_strength``."""
    from rlhf.runtime.config.options import parse_key_values

    name = parse_key_values(config.dpo_config, "--dpo-config").get("objective", config.objective)
    registry = plugins.registry("objective")
    objective = registry.component(name)
    if objective.capabilities["preference_strength"] is None:
        usable = [c.name for c in registry.components() if c.capabilities["preference_strength"] is not None]
        raise ConfigError(f"rlhf iterate trains each round on preference pairs, and the {objective.name!r} objective "
                          "does not declare that it learns from them (register(..., preference_strength=SETTING)); "
                          f"use --objective {' or '.join(usable) or 'NAME of one that does'}")
    return objective


def check_dpo_options(config: IterateConfig, plugins: Any) -> None:
    """The rounds' fit options (``--dpo-config`` included) checked as round 1's fit run would check
    them, before any round samples: a typo would otherwise stop the run only after round 1's generation."""
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.config.fit_plan import FitPlan

    objective = _objective(config, plugins)
    first = Path(config.out) / "round_1"
    values, _ = _dpo_values(config, objective, config.model, first / "pairs.jsonl", first / objective.name, plugins)
    try:
        FitPlan.make(FitConfig.from_dict(values, plugins), plugins)
    except RlhfError as exc:  # name iterate's flag, not the DPO run's, in the advice
        exc.args = (re.sub(r"(?<![\w-])--batch-size\b", "--dpo-batch-size", str(exc)),) + exc.args[1:]
        raise


def _dpo(config: IterateConfig, objective: Any, start: str, pairs: Path, run_dir: Path, plugins: Any) -> Path:
    """The ``objective``'s fit run (``rlhf dpo`` by default) on ``pairs`` from ``start`` (policy and
    reference) into ``run_dir``; ``--beta`` sets its preference strength."""
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.fit.local import fit

    values, merge = _dpo_values(config, objective, start, pairs, run_dir, plugins)
    final = run_dir / "final"
    values["resume"] = run_dir.exists() and any(run_dir.iterdir())
    if not final.is_dir():  # written whole or not at all (runtime.run.checkpoint.write_directory)
        try:
            fit(FitConfig.from_dict(values, plugins), plugins=plugins)
        except RlhfError as exc:  # name iterate's flag, not the DPO run's, in the advice
            exc.args = (re.sub(r"(?<![\w-])--batch-size\b", "--dpo-batch-size", str(exc)),) + exc.args[1:]
            raise
    return final / "merged" if merge is not None and (final / "merged").is_dir() else final


def _dpo_values(config: IterateConfig, objective: Any, start: str, pairs: Path, run_dir: Path,
                plugins: Any) -> tuple[dict[str, Any], str | None]:
    """The fit options of a round's run (see `_dpo`), and the model adapter's merge setting (None: none)."""
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.config.options import parse_key_values

    values: dict[str, Any] = {
        "objective": objective.name, "model": start, "data": [str(pairs)], "out": str(run_dir), "lr": config.lr,
        "epochs": config.epochs, "batch_size": config.dpo_batch_size, "micro_batch_size": config.micro_batch_size,
        "max_len": config.max_len, "seed": config.seed, "tokenizer": config.tokenizer, "dtype": config.dtype,
        "device": config.device, "trust_remote_code": config.trust_remote_code,
        "apply_chat_template": config.apply_chat_template, "input_template": config.input_template,
        "threads": config.threads, "progress": config.progress, "model_adapter": config.model_adapter,
        "components": {"model_adapter": dict(config.components.get("model_adapter", {})),
                       "objective": {objective.capabilities["preference_strength"]: config.beta}},
    }
    fit_fields = {f.name for f in dataclasses.fields(FitConfig)}
    short_flags = FitConfig.short_flags(plugins)
    for key, value in parse_key_values(config.dpo_config, "--dpo-config").items():
        if key in fit_fields or key in short_flags:
            values[key] = value
        else:  # the objective's own settings (dpo: label_smoothing, ipo, nll_coef, ...)
            values["components"]["objective"][key] = value
    values["objective"] = objective.name
    adapter_settings = values["components"]["model_adapter"]
    merge = plugins.registry("model").component(config.model_adapter).capabilities["merge_setting"]
    if merge is not None and merge not in values and merge not in adapter_settings:
        # the next round starts from a full model, not from an adapter on an adapter (an adapter
        # that trains every weight saves the model itself, merged or not)
        adapter_settings[merge] = True
    return values, merge


def _last_metrics(run_dir: Path) -> dict[str, float]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [line for line in lines if "train/loss" in line]
    return {k: v for k, v in (train or lines or [{}])[-1].items() if isinstance(v, (int, float))}


def _write_config(out: Path, config: IterateConfig) -> None:
    import yaml

    path = out / "config.yaml"
    if not path.exists():
        _atomic_write(path, yaml.safe_dump(json.loads(json.dumps(config.to_dict(), default=str)), sort_keys=False))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
