"""``--resume`` refuses every option that changes what a run trains unless ``--resume-override``
names it (rlhf/runtime/run/run_dir.py, ``RunDirectory.check_start``): a walk over every option of
``rlhf train`` and of the fit commands (the config dataclasses in rlhf/runtime/config/, nested
groups and every component setting as config.yaml records them). The options a resumed run may
change freely are listed here, each with its reason; an option added to ``RESUME_FREE`` without
one fails this test, and so does one config.yaml leaves out (a change to it would go unseen)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.run import checkpoint
from rlhf.runtime.run.run_dir import RESUME_FREE, RunDirectory, _flatten

pytestmark = pytest.mark.unit

# option -> why a resumed run may change it (how the run reports, saves and is launched; not what it trains)
FREE = {
    "resume": "how this invocation starts, not what the run trains",
    "resume_override": "names the options a resume changes; it is itself no option of the training",
    "out": "the run directory itself: a run moved elsewhere resumes from there",
    "progress": "the progress bar",
    "save_every": "how often a checkpoint is written, not what is trained",
    "keep_checkpoints": "how many checkpoints are kept",
    "save_hf_every": "how often an HF export is written",
    "threads": "CPU threads: the same math (a resume without --threads takes the run's own count)",
    "tensorboard": "a logger",
    "wandb_project": "a logger's destination",
    "wandb_group": "a logger's destination",
    "wandb_run_name": "a logger's destination",
    "log_samples": "how many samples are logged",
    "log_tokens": "how many samples' tokens are logged (tokens.jsonl)",
    "ray_address": "which Ray cluster runs the actors",
    "ray_place": "where the actors are placed, not what they compute",
    "device": "where the model runs; the same math",
    "verify_weight_sync": "a check of each weight sync that stops a broken run; a passing run trains the same",
    "weight_sync_timeout_s": "how long a weight sync may take before the run stops, not what it computes",
}


def test_the_free_options_are_exactly_those_with_a_reason():
    assert set(FREE) == set(RESUME_FREE)


def changed(value):
    """Another value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "_changed"
    if isinstance(value, list):
        return value + ["changed"]
    if isinstance(value, dict):
        return {**value, "changed": True}
    assert value is None, f"no changed value for {value!r}"
    return "changed"


def train_plan(tmp_path, plugins):
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.config.train_plan import RunPlan

    config = TrainConfig.from_dict(dict(model="m", data=["d.jsonl"], reward=["r.py"], out=str(tmp_path / "run"),
                                        steps=4, eval_data=["e.jsonl"]), plugins)
    return RunPlan.make(config, plugins), TrainConfig


def fit_plan(tmp_path, plugins):
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.config.fit_plan import FitPlan

    config = FitConfig.from_dict(dict(model="m", data=["d.jsonl"], objective="dpo", out=str(tmp_path / "run"),
                                      steps=4), plugins)
    return FitPlan.make(config, plugins), FitConfig


PLANS = {"train": train_plan, "fit": fit_plan}


@pytest.fixture(params=list(PLANS))
def started(request, tmp_path):
    """A run directory with the config.yaml of a plan and a checkpoint: a run to resume."""
    plugins = build_plugin_manager(load_entrypoints=False)
    plan, config_cls = PLANS[request.param](tmp_path, plugins)
    config = plan.run_config()
    run = RunDirectory(plan.out_dir)
    run.prepare(config=config, plugins={}, resume=False)
    checkpoint.save_checkpoint(plan.out_dir, 2, workers={}, trainer_state={}, keep=0)
    return run, config, config_cls


def test_config_yaml_records_every_option_of_the_command(started):
    run, config, config_cls = started
    recorded = yaml.safe_load((run.path / "config.yaml").read_text())
    from rlhf.runtime.run.run_dir import INVOCATION_ONLY

    # --resume and --resume-override say how a process started, not what the run is: config.yaml stays
    # reusable as a fresh run's --config (issue 53)
    assert not set(INVOCATION_ONLY) & set(recorded)
    fields = {f.name for f in dataclasses.fields(config_cls)} - {"components"} - set(INVOCATION_ONLY)
    assert fields <= set(recorded), f"left out of config.yaml: {sorted(fields - set(recorded))}"
    assert recorded["components"] and all(isinstance(s, dict) for s in recorded["components"].values())
    run_options = {k: v for k, v in config.items() if k not in INVOCATION_ONLY}
    assert _flatten(recorded) == _flatten(run_options)  # what the resume compares is what was recorded


def test_every_option_that_changes_the_run_is_refused_unless_overridden(started):
    run, config, _ = started
    flat = _flatten(config)
    assert len(flat) > 50 and "seed" in flat and "backend.max_grad_norm" in flat  # the walk covers the options
    refused, accepted = [], []
    for key, value in flat.items():
        now = _flatten_back(config, key, changed(value))
        try:
            run.check_start(now, resume=True, overrides=[])
            accepted.append(key)
        except ConfigError as exc:
            refused.append(key)
            assert f"{key}: {value!r} -> {changed(value)!r}" in str(exc), key
            assert f"--resume-override {key}" in str(exc), key
            run.check_start(now, resume=True, overrides=[key])  # named: accepted
    assert sorted(accepted) == sorted(k for k in flat if k in FREE)
    assert sorted(refused) == sorted(k for k in flat if k not in FREE)


def _flatten_back(config, key, value):
    """``config`` (as config.yaml holds it) with the flat ``key`` set to ``value``."""
    out = {**config, "components": {slot: dict(settings) for slot, settings in config["components"].items()}}
    slot, dot, name = key.partition(".")
    if dot and slot in out["components"]:
        out["components"][slot][name] = value
    else:
        out[key] = value
    return out


def test_a_changed_seed_is_refused_through_start_run_and_accepted_when_overridden(started):
    """The path a run takes: `start_run` compares the plan's config with the run's."""
    from rlhf.runtime.run.lifecycle import start_run

    run, config, config_cls = started
    plugins = build_plugin_manager(load_entrypoints=False)
    values = {k: v for k, v in config.items() if k != "components"}
    values.update(resume=True, seed=config["seed"] + 1)
    with pytest.raises(ConfigError, match=r"seed: 42 -> 43.*--resume-override seed"):
        start_run(started_plan(config_cls, values, plugins), plugins, world_size=1, threads=False)
    lock = start_run(started_plan(config_cls, {**values, "resume_override": ["seed"]}, plugins), plugins,
                     world_size=1, threads=False)
    lock.release()


def started_plan(config_cls, values, plugins):
    from rlhf.runtime.config.fit_plan import FitPlan
    from rlhf.runtime.config.train_plan import RunPlan

    config = config_cls.from_dict(values, plugins)
    return (RunPlan if config_cls.__name__ == "TrainConfig" else FitPlan).make(config, plugins)
