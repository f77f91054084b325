"""Hub names (``org/name``) for every model option (rlhf/core/hub.py): ``--reward`` (a reward model),
``--critic-model``, ``--teacher``, and ``--model`` (the policy and the reference, which loads
``--model`` too) resolve through the Hugging Face cache with ``HF_HUB_OFFLINE=1`` (tests/conftest.py),
and train exactly as the same model given as a local directory; a name that is nothing is one
usage error naming the flag, before any model loads.

The cache is the one ``HF_HOME`` points to, laid out as a download leaves it:
``HF_HOME/hub/models--org--name/snapshots/<commit>/`` and ``refs/main`` holding the commit."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rlhf.rewards.loading import build_source
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.reward_model import RewardModelSource
from rlhf.runtime.ray.placement import names_reward_model
from tests.helpers import read_jsonl, run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_as_hub_model(folder: Path, name: str) -> Path:
    """``folder`` copied into the HF cache as the hub model ``name`` (its snapshot folder)."""
    from huggingface_hub import constants

    hub = Path(os.environ["HF_HOME"]) / "hub"
    assert Path(constants.HF_HUB_CACHE) == hub  # the cache the hub client reads
    repo = hub / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A one-label Llama classifier on the tiny model (its score head drawn from seed 3)."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("reward-model")
    torch.manual_seed(3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = LlamaForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1,
                                                           pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hub(tiny_model_dir, reward_model_dir, fit_teacher) -> dict[str, tuple[Path, str]]:
    """Each model as (local directory, hub name in the cache)."""
    models = {"policy": (tiny_model_dir, "rlhf-tests/tiny-policy"), "reward": (reward_model_dir, "rlhf-tests/tiny-rm"),
              "teacher": (fit_teacher, "rlhf-tests/tiny-teacher")}
    for folder, name in models.values():
        cache_as_hub_model(folder, name)
    return models


def train_args(model, task, out, *extra, reward=None):
    return ["train", "--model", str(model), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(reward or task / "rewards.py"), "--prompts-per-step", "2", "--n-samples", "2",
            "--max-new-tokens", "3", "--micro-batch-size", "2", "--steps", "1", "--out", str(out), "--no-progress",
            *extra]


def distill_args(model, data, out, teacher):
    return ["distill", "--model", str(model), "--data", str(data / "sft.jsonl"), "--teacher", str(teacher),
            "--batch-size", "4", "--steps", "1", "--out", str(out), "--no-progress"]


def training_rows(out: Path) -> list[dict]:
    """metrics.jsonl without timings and throughput (the only values two equal runs may differ in)."""
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "perf/"))}
            for row in read_jsonl(out / "metrics.jsonl")]


@pytest.mark.run
@pytest.mark.parametrize("flag", ["--reward", "--critic-model", "--model", "--teacher"])
def test_a_hub_name_trains_exactly_like_the_same_model_as_a_local_directory(flag, hub, task, fit_data, tmp_path,
                                                                             plugins):
    policy_dir, _ = hub["policy"]

    def args(use_hub: bool, out: Path) -> list[str]:
        def ref(role: str) -> str:
            folder, name = hub[role]
            return name if use_hub else str(folder)

        if flag == "--reward":
            return train_args(policy_dir, task, out, reward=ref("reward"))
        if flag == "--critic-model":
            return train_args(policy_dir, task, out, "--algo", "ppo", "--critic-model", ref("reward"))
        if flag == "--model":  # the policy and the reference both load it
            return train_args(ref("policy"), task, out, "--kl-coef", "0.1")
        return distill_args(policy_dir, fit_data, out, ref("teacher"))

    for use_hub, out in ((False, tmp_path / "local"), (True, tmp_path / "hub")):
        result = run_cli(plugins, args(use_hub, out))
        assert result.exit_code == 0, result.output
    hub_rows, local_rows = training_rows(tmp_path / "hub"), training_rows(tmp_path / "local")
    if flag == "--reward":  # the reward model scored the run: its source is named after the hub model
        assert "reward/tiny-rm" in hub_rows[0], sorted(hub_rows[0])
        local_name = hub["reward"][0].name  # a local one after its directory
        local_rows = [{k.replace(local_name, "tiny-rm"): v for k, v in row.items()} for row in local_rows]
    assert hub_rows == local_rows and hub_rows
    if flag == "--critic-model":
        assert "critic/loss" in hub_rows[0]


@pytest.mark.unit
@pytest.mark.parametrize("flag", ["--reward", "--critic-model", "--teacher"])
def test_a_name_that_is_nothing_is_one_usage_error_before_any_model_loads(flag, task, fit_data, tmp_path, plugins):
    """The policy model does not exist either: the flag's error comes first, so nothing was loaded."""
    missing, no_model = "rlhf-tests/no-such-model", tmp_path / "no-policy"
    if flag == "--reward":
        args = train_args(no_model, task, tmp_path / "run", reward=missing)
    elif flag == "--critic-model":
        args = train_args(no_model, task, tmp_path / "run", "--algo", "ppo", "--critic-model", missing)
    else:
        args = distill_args(no_model, fit_data, tmp_path / "run", missing)
    result = run_cli(plugins, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert errors[0].startswith(f"Error: {flag} {missing}: not a local directory, and the hub model {missing} is not "
                                "in the Hugging Face cache"), errors[0]
    assert "HF_HUB_OFFLINE=1" in errors[0] and "pass a local model directory" in errors[0]
    if flag == "--reward":
        assert "is no registered reward, file.py or module:attr, so it is taken as a hub reward model" in errors[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.unit
def test_path_like_and_file_references_are_said_as_such(task, tmp_path, plugins):
    (tmp_path / "weights.bin").write_text("")
    for ref, words in ((str(tmp_path / "nowhere"), "no such directory, and not a hub name (org/name)"),
                       (str(tmp_path / "weights.bin"), "is a file; pass a model directory"),
                       (str(tmp_path), "the directory has no config.json")):
        result = run_cli(plugins, train_args(tmp_path / "no-policy", task, tmp_path / "run", "--algo", "ppo",
                                             "--critic-model", ref))
        assert result.exit_code == 2 and f"--critic-model {ref}" in result.output and words in result.output, (
            result.output)


@pytest.mark.unit
def test_how_a_reward_spec_is_classified(hub, task, tmp_path, monkeypatch, plugins):
    """Registered name -> function; file.py / module:attr -> function; a local directory (even one
    spelled org/name) -> that reward model; org/name naming nothing here -> the hub model."""
    registry, options = plugins.registry("reward"), RewardOptions()
    reward_dir, name = hub["reward"]

    hub_source = build_source(name, registry, options)
    assert isinstance(hub_source, RewardModelSource) and hub_source.name == "tiny-rm"
    assert hub_source.worker.path.parent.name == "snapshots" and hub_source.worker.path.name == COMMIT  # the cache

    monkeypatch.chdir(tmp_path)
    shutil.copytree(reward_dir, tmp_path / "rlhf-tests" / "tiny-rm")  # a local folder of the same spelling wins
    local = build_source(name, registry, options)
    assert isinstance(local, RewardModelSource) and local.worker.path == Path(name)

    assert not isinstance(build_source("exact_match", registry, options), RewardModelSource)
    assert not isinstance(build_source(str(task / "rewards.py"), registry, options), RewardModelSource)
    # the Ray runtime gives a hub reward model a reward actor of its own, as a local one
    assert names_reward_model(["other-org/rm@0.5"]) and not names_reward_model(["exact_match", "rewards.py"])


@pytest.mark.unit
def test_online_a_cached_model_needs_no_hub_and_a_missing_one_is_looked_up(hub, monkeypatch):
    """With the hub allowed: a cached name is enough; an uncached one is looked up once (here the hub,
    faked, says no such repository) and refused before anything downloads."""
    import huggingface_hub
    from huggingface_hub import constants

    from rlhf.core import hub as hub_names
    from rlhf.core.errors import ConfigError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_names, "check_hub_reachable", lambda name: None)
    asked = []
    monkeypatch.setattr(huggingface_hub, "repo_exists", lambda name: asked.append(name) or False)
    hub_names.check_model_option(hub["teacher"][1], "--teacher")
    assert asked == []
    with pytest.raises(ConfigError, match=r"^--teacher org/nothing: no such model on the hub \(https://"):
        hub_names.check_model_option("org/nothing", "--teacher")
    assert asked == ["org/nothing"]
