"""The fit loop end to end through the real CLI on a tiny random model: every command writes its
run directory and a model ``from_pretrained`` loads, an optimizer step does not depend on the
micro-batch size or the number of ranks, ``--resume`` reproduces the uninterrupted run, eval and
``--save-best``, and errors that name the problem."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import rlhf

from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.helpers import assert_same_gradients, command_args, read_jsonl, run_cli, torchrun, write_jsonl
from tests.runtime.recording import RecordingBackend, recording_plugin

ROOT = Path(__file__).resolve().parents[2]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.mark.run
@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "kto", "prm", "distill", "fit"])
def test_each_command_trains_and_the_step_does_not_depend_on_the_micro_batch_size(
        command, tiny_model_dir, fit_data, fit_teacher, tmp_path):
    """Two optimizer steps of 4 examples, in micro-batches of 1 and of 4: the same gradients (the
    recording backend keeps them; plain SGD, as Adam would magnify rounding noise) and weights."""
    runs = []
    for micro in (1, 4):
        out = tmp_path / f"micro{micro}"
        plugins = build_plugin_manager(load_entrypoints=False)
        plugins.register(recording_plugin())
        RecordingBackend.steps.clear()
        args = command_args(command, tiny_model_dir, fit_data, fit_teacher) + [
            "--batch-size", "4", "--micro-batch-size", str(micro), "--steps", "2", "--lr", "0.1",
            "--backend", "recording", "--out", str(out), "--no-progress"]
        result = run_cli(plugins, args)
        assert result.exit_code == 0, result.output
        for name in ("config.yaml", "plugins.json", "metrics.jsonl", "final/config.json"):
            assert (out / name).exists(), name
        metrics = read_jsonl(out / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["train/loss"]) for m in metrics)
        runs.append((list(RecordingBackend.steps), weights(out / "final"), metrics))
    (steps_one, final_one, metrics_one), (steps_four, final_four, metrics_four) = runs
    assert len(steps_one) == len(steps_four) == 2
    for one, four in zip(steps_one, steps_four):
        assert_same_gradients(four, one, atol=1e-5)
    for name, value in final_one.items():
        assert torch.allclose(value, final_four[name], atol=1e-5), name
    for a, b in zip(metrics_one, metrics_four):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)
    start = weights(tiny_model_dir)
    assert any(not torch.allclose(start[n], v) for n, v in final_one.items() if n in start)  # it did train


@pytest.mark.run
def test_the_rm_command_writes_a_sequence_classifier_that_rlhf_train_scores_with(tiny_model_dir, fit_data, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.core.types import Trajectory
    from rlhf.rewards import load_rewards

    out = tmp_path / "rm"
    args = command_args("rm", tiny_model_dir, fit_data, fit_data)
    result = run_cli(build_plugin_manager(load_entrypoints=False), args + [
        "--batch-size", "4", "--steps", "2", "--lr", "1e-2", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["num_labels"] == 1 if "num_labels" in config else len(config["id2label"]) == 1
    assert config["reward_append_eos"] is True and config["normalize_reward"] is True and config["std"] > 0
    model = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert model.config.pad_token_id == tokenizer.pad_token_id
    prompt, completion = "Q: cat?", "cat"
    ids = tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]  # as the rm objective encodes
    with torch.no_grad():
        raw = float(model(torch.tensor([ids + [tokenizer.eos_token_id]])).logits[0, 0])
    expected = (raw - config["mean"]) / config["std"]
    rewards = load_rewards([str(out / "final")], plugins=build_plugin_manager(load_entrypoints=False))
    trajectory = Trajectory(token_ids=ids, loss_mask=[0] * (len(ids) - 1) + [1], prompt_length=len(ids) - 1,
                            prompt=prompt, prompt_text=prompt, completion_text=completion, group=0)
    scored = rewards.score_trajectories([trajectory]).total[0]
    assert scored == pytest.approx(expected, abs=1e-4)


@pytest.mark.run
def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, fit_data, tmp_path, make_plugin):
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.fit.local import fit

    def config(out: Path, **extra) -> FitConfig:
        return FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(fit_data / "kto.jsonl")],
                                    "objective": "kto", "objective.output_key": "completion", "batch_size": 4,
                                    "micro_batch_size": 2, "epochs": 2, "lr": 1e-2, "lr_scheduler": "cosine", "threads": 1,
                                    "save_every": 2, "out": str(out), "progress": False, **extra})

    straight = tmp_path / "straight"
    fit(config(straight), plugins=build_plugin_manager(load_entrypoints=False))

    def crash(step):
        if step == 2:
            raise KeyboardInterrupt  # killed after step 3 was logged, before its checkpoint

    interrupted = tmp_path / "interrupted"
    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(make_plugin("killer", on_step_end=rlhf.hookimpl(trylast=True)(crash)))  # after the loggers
    with pytest.raises(KeyboardInterrupt):
        fit(config(interrupted), plugins=plugins)
    assert not (interrupted / "final").exists()
    assert [m["step"] for m in read_jsonl(interrupted / "metrics.jsonl")] == [1, 2, 3]
    fit(config(interrupted, resume=True), plugins=build_plugin_manager(load_entrypoints=False))

    keys = ("train/loss", "train/grad_norm", "train/accuracy", "train/kl")
    expected = [{k: m[k] for k in keys} for m in read_jsonl(straight / "metrics.jsonl")]
    assert len(expected) == 4  # two epochs of two steps: the second epoch is a new shuffle
    assert [{k: m[k] for k in keys} for m in read_jsonl(interrupted / "metrics.jsonl")] == expected  # step 3 once
    for name, value in weights(straight / "final").items():
        assert torch.equal(value, weights(interrupted / "final")[name]), name


@pytest.mark.run
def test_eval_runs_on_schedule_and_save_best_keeps_the_best_model(tiny_model_dir, fit_data, tmp_path):
    out = tmp_path / "run"
    args = command_args("dpo", tiny_model_dir, fit_data, fit_data)
    result = run_cli(build_plugin_manager(load_entrypoints=False), args + [
        "--eval-data", str(fit_data / "pairs.jsonl"), "--batch-size", "2", "--micro-batch-size", "2", "--steps", "4",
        "--lr", "1e-2", "--eval-every", "2", "--save-best", "eval/accuracy", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(out / "metrics.jsonl")
    evals = {m["step"]: m for m in metrics if "eval/loss" in m}
    assert sorted(evals) == [2, 4]
    for m in evals.values():
        assert {"eval/accuracy", "eval/margin", "eval/chosen_reward", "eval/rejected_reward"} <= set(m)
    best = json.loads((out / "best" / "best.json").read_text())
    top = max(evals.values(), key=lambda m: m["eval/accuracy"])["eval/accuracy"]
    assert best["metric"] == "eval/accuracy" and best["value"] == top
    assert evals[best["step"]]["eval/accuracy"] == top and min(s for s in evals if evals[s]["eval/accuracy"] == top) \
        == best["step"]
    assert (out / "best" / "model.safetensors").exists()


@pytest.mark.cluster
def test_two_ranks_take_the_same_steps_as_one(tiny_model_dir, fit_data, tmp_path):
    """KTO under torchrun: the step's reference point and units are summed over both ranks."""
    finals = []
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        torchrun(nproc, "-m", "rlhf", *command_args("kto", tiny_model_dir, fit_data, fit_data), "--batch-size", "4",
                 "--micro-batch-size", "1", "--steps", "2", "--lr", "1e-2", "--out", str(out), "--no-progress",
                 "--eval-data", str(fit_data / "kto.jsonl"), cwd=ROOT)
        finals.append((weights(out / "final"), read_jsonl(out / "metrics.jsonl")))
    (one, one_metrics), (two, two_metrics) = finals
    for name, value in one.items():
        assert torch.allclose(value, two[name], atol=2e-5), name
    for a, b in zip(one_metrics, two_metrics):
        for key in ("train/loss", "train/kl", "train/accuracy", "eval/loss", "eval/accuracy"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


# --- errors -----------------------------------------------------------------------------------------


def fit_error(args: list[str]) -> str:
    result = run_cli(build_plugin_manager(load_entrypoints=False), args + ["--no-progress"])
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    return result.output


@pytest.mark.unit
def test_a_missing_column_names_the_file_and_the_columns_present(tiny_model_dir, fit_data, tmp_path):
    output = fit_error(["rm", "--model", str(tiny_model_dir), "--data", str(fit_data / "sft.jsonl"),
                        "--out", str(tmp_path / "r")])
    assert "sft.jsonl: no column 'chosen' (columns: prompt, response)" in output


@pytest.mark.unit
def test_a_bad_row_names_its_file_and_row(tiny_model_dir, tmp_path):
    bad = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "a", "completion": "b", "label": True},
                                                {"prompt": "a", "completion": "c", "label": "maybe"}])
    output = fit_error(["kto", "--model", str(tiny_model_dir), "--data", str(bad), "--output-key", "completion",
                        "--batch-size", "1", "--out", str(tmp_path / "r")])
    assert "kto.jsonl row 2: 'label' must be true/false" in output


@pytest.mark.run
def test_a_pair_whose_chosen_equals_its_rejected_is_counted_and_skipped(tiny_model_dir, tmp_path, caplog):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                                    {"prompt": "a", "chosen": "same", "rejected": "same"},
                                                    {"prompt": "a", "chosen": "d", "rejected": "d"}])
    with caplog.at_level("WARNING"):
        result = run_cli(build_plugin_manager(load_entrypoints=False), [
            "dpo", "--model", str(tiny_model_dir), "--data", str(pairs), "--batch-size", "1", "--out",
            str(tmp_path / "r"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "pairs.jsonl row 2: chosen equals rejected; skipped (2 rows of --data in all)" in caplog.text
    assert len(read_jsonl(tmp_path / "r" / "metrics.jsonl")) == 1  # one usable pair, one step


@pytest.mark.unit
def test_a_margin_column_the_data_lacks_names_the_file_and_the_columns(tiny_model_dir, fit_data, tmp_path):
    message = fit_error(["rm", "--model", str(tiny_model_dir), "--data", str(fit_data / "pairs.jsonl"),
                         "--margin-key", "margin", "--out", str(tmp_path / "run")])
    assert "pairs.jsonl" in message and "margin" in message and "chosen" in message


@pytest.mark.run
@pytest.mark.parametrize("command", ["sft", "dpo", "kto", "prm", "distill", "fit"])
def test_a_runs_own_config_yaml_reruns_it_with_its_command(command, tiny_model_dir, fit_data, fit_teacher, tmp_path):
    """``rlhf sft --config runs/sft/config.yaml`` (it used to say "unknown option(s) objective"): the
    rerun trains the same weights; another objective's command refuses the file in one line."""
    first = tmp_path / "first"
    args = command_args(command, tiny_model_dir, fit_data, fit_teacher) + [
        "--batch-size", "2", "--steps", "1", "--out", str(first), "--no-progress"]
    assert run_cli(build_plugin_manager(load_entrypoints=False), args).exit_code == 0
    again = run_cli(build_plugin_manager(load_entrypoints=False),
                    [command, "--config", str(first / "config.yaml"), "--out", str(tmp_path / "again"), "--no-progress"])
    assert again.exit_code == 0, again.output
    for key, value in weights(first / "final").items():
        assert torch.equal(value, weights(tmp_path / "again" / "final")[key]), key
    if command == "sft":
        other = run_cli(build_plugin_manager(load_entrypoints=False),
                        ["dpo", "--config", str(first / "config.yaml"), "--out", str(tmp_path / "dpo")])
        assert other.exit_code == 2 and "sets objective 'sft', and this command is for objective 'dpo'" in other.output
        assert not (tmp_path / "dpo").exists()


@pytest.mark.run
def test_the_prompt_format_travels_with_the_model_to_the_next_stage(tiny_model_dir, fit_data, tmp_path):
    """sft records its prompt format in final/ (and best/); dpo from that model formats prompts the
    same way unless told otherwise, and says so."""
    import yaml

    sft = tmp_path / "sft"
    template = "Q: {}\nA: "
    result = run_cli(build_plugin_manager(load_entrypoints=False), [
        "sft", "--model", str(tiny_model_dir), "--data", str(fit_data / "sft.jsonl"), "--eval-data",
        str(fit_data / "sft.jsonl"), "--save-best", "eval/loss", "--input-template", template, "--batch-size", "2",
        "--steps", "1", "--out", str(sft), "--no-progress"])
    assert result.exit_code == 0, result.output
    for folder in ("final", "best"):
        assert json.loads((sft / folder / "prompt_format.json").read_text()) == {
            "apply_chat_template": False, "input_template": template}

    def dpo(out: str, *extra: str):
        result = run_cli(build_plugin_manager(load_entrypoints=False), [
            "dpo", "--model", str(sft / "final"), "--data", str(fit_data / "pairs.jsonl"), "--batch-size", "2",
            "--steps", "1", "--out", str(tmp_path / out), "--no-progress", *extra])
        assert result.exit_code == 0, result.output
        return result.output, yaml.safe_load((tmp_path / out / "config.yaml").read_text())

    said, config = dpo("dpo")
    assert config["input_template"] == template and config["apply_chat_template"] is False
    assert f"prompts are formatted with the input template {template!r}, as {sft / 'final'} was trained" in said
    said, config = dpo("dpo_plain", "--input-template", "{}")  # an explicit flag wins, silently
    assert config["input_template"] == "{}" and "was trained" not in said


@pytest.mark.unit
def test_an_objective_that_distills_says_it_needs_a_teacher(tiny_model_dir, fit_data, tmp_path):
    output = fit_error(["distill", "--model", str(tiny_model_dir), "--data", str(fit_data / "sft.jsonl"),
                        "--out", str(tmp_path / "r")])
    assert "pass --teacher MODEL" in output


@pytest.mark.unit
def test_an_unknown_objective_suggests_the_closest(tiny_model_dir, fit_data, tmp_path):
    output = fit_error(["fit", "--objective", "dpp", "--model", str(tiny_model_dir), "--data",
                        str(fit_data / "sft.jsonl"), "--out", str(tmp_path / "r")])
    assert "dpo" in output


@pytest.mark.run
def test_a_third_party_objective_runs_through_rlhf_fit(tiny_model_dir, fit_data, tmp_path, make_plugin):
    """A plugin registering its own objective (here: SFT on the responses' first token only)."""
    from rlhf.core.protocols.objective import ObjectiveBase, require
    from rlhf.objectives import sft_loss, token_batch

    class FirstToken(ObjectiveBase):
        def columns(self):
            return ["prompt", "response"]

        def encode(self, row, text):
            prompt_ids = text.prompt_ids(text.prompt(require(row, "prompt")))
            ids, prompt_len = text.join(prompt_ids, text.ids(text.response(row["prompt"], row["response"])))
            return ids, [0] * prompt_len + [1] + [0] * (len(ids) - prompt_len - 1)

        def collate(self, examples, pad_token_id):
            return token_batch(examples, pad_token_id)

        def units(self, batch):
            return float(batch["loss_mask"].sum())

        def loss(self, models, batch, stats):
            logits = models.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["input_ids"].masked_fill(batch["loss_mask"] == 0, -100)
            return sft_loss(logits, labels), {}

    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(make_plugin("my_objectives", register_objectives=lambda register: register(
        "first_token", FirstToken, default_lr=1e-3)))
    out = tmp_path / "run"
    result = run_cli(plugins, ["fit", "--objective", "first_token", "--model", str(tiny_model_dir), "--data",
                               str(fit_data / "sft.jsonl"), "--batch-size", "4", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert len(read_jsonl(out / "metrics.jsonl")) == 2
    assert read_jsonl(out / "metrics.jsonl")[0]["train/units"] == 4.0  # one learnt token per example
    import yaml

    assert yaml.safe_load((out / "config.yaml").read_text())["lr"] == 1e-3  # the objective's default_lr


@pytest.mark.cluster
@pytest.mark.deepspeed
@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_zero3_takes_the_same_steps_as_the_torch_backend(command, tiny_model_dir, fit_data, tmp_path):
    """ZeRO-3 (parameters sharded; exported through full_weights) against the torch backend, with
    eval and --save-best exporting mid-run."""
    finals = {}
    for backend in ("torch", "deepspeed"):
        out = tmp_path / backend
        extra = ["--zero-stage", "3"] if backend == "deepspeed" else []
        args = command_args(command, tiny_model_dir, fit_data, fit_data)
        result = run_cli(build_plugin_manager(load_entrypoints=False), args
                         + ["--batch-size", "4", "--micro-batch-size", "2", "--steps", "2", "--lr", "1e-3",
                            "--eval-data", str(fit_data / "pairs.jsonl"), "--eval-every", "1", "--save-best",
                            "eval/loss", "--backend", backend, *extra, "--out", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        finals[backend] = (weights(out / "final"), read_jsonl(out / "metrics.jsonl"))
        assert (out / "best" / "best.json").exists()
    (expected, expected_metrics), (got, got_metrics) = finals["torch"], finals["deepspeed"]
    for name, value in expected.items():
        assert torch.allclose(got[name], value, atol=1e-5), name
    for a, b in zip(expected_metrics, got_metrics):
        assert b["eval/loss"] == pytest.approx(a["eval/loss"], rel=1e-4)


@pytest.mark.unit
def test_with_lora_the_reference_is_the_model_with_its_adapter_off(tiny_model_dir, fit_data, tmp_path):
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.fit.local import build_parts
    from rlhf.runtime.config.fit_plan import FitPlan

    config = FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(fit_data / "pairs.jsonl")],
                                  "objective": "dpo", "lora_rank": 4, "batch_size": 4, "out": str(tmp_path / "r")})
    run, _ = build_parts(FitPlan.make(config, build_plugin_manager(load_entrypoints=False)))
    trained = {p.data_ptr() for p in run.trained.model.parameters()}
    reference = list(run.reference.parameters())
    assert reference and all(p.data_ptr() in trained for p in reference)  # one copy of the base weights
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    with torch.no_grad():
        for p in run.trained.model.parameters():
            if p.requires_grad:
                p.add_(0.5)  # move the adapter: the trained model changes, the reference must not
        trained_logits = run.trained.model(**batch).logits
        reference_logits = run.reference(**batch).logits
        from transformers import AutoModelForCausalLM

        base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(**batch).logits
    assert torch.allclose(reference_logits, base_logits, atol=1e-5)
    assert not torch.allclose(trained_logits, base_logits, atol=1e-3)


@pytest.mark.run
def test_resume_warns_about_a_changed_plugin_set_and_only_then(tiny_model_dir, fit_data, tmp_path, make_plugin,
                                                               caplog):
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.fit.local import fit

    def config(steps: int, **extra) -> FitConfig:
        return FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(fit_data / "sft.jsonl")],
                                    "objective": "sft", "batch_size": 4, "steps": steps, "save_every": 1,
                                    "threads": 1, "out": str(tmp_path / "run"), "progress": False, **extra})

    fit(config(1), plugins=build_plugin_manager(load_entrypoints=False))
    caplog.clear()
    fit(config(2, resume=True, resume_override=["steps"]), plugins=build_plugin_manager(load_entrypoints=False))
    assert "different plugin set" not in caplog.text
    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(make_plugin("newcomer", on_step_end=lambda step: None))
    fit(config(3, resume=True, resume_override=["steps"]), plugins=plugins)
    assert "resuming with a different plugin set" in caplog.text


@pytest.mark.unit
def test_under_sharded_weights_a_rank_short_of_micro_batches_repeats_one_uncounted():
    """Every forward is a collective under ZeRO-3: a rank with fewer eval micro-batches than another
    runs its first one again, and that pass counts for nothing."""
    from types import SimpleNamespace

    from rlhf.runtime.fit.loop import FitLoop

    class TwoRanks:
        active = True

        def shard(self, examples):
            return examples

        def all_gather(self, count):
            return [count, count + 1]  # the other rank has one micro-batch more

    loop = SimpleNamespace(dist=TwoRanks(), trained=SimpleNamespace(backend=SimpleNamespace(shards_weights=True)),
                           _micro_batches=lambda examples: [[example] for example in examples])
    assert list(FitLoop._passes(loop, ["a", "b"])) == [(["a"], True), (["b"], True), (["a"], False)]
    loop.trained.backend.shards_weights = False  # forwards are not collectives: no extra pass
    assert list(FitLoop._passes(loop, ["a", "b"])) == [(["a"], True), (["b"], True)]


@pytest.mark.run
def test_a_run_names_the_plugins_that_failed_to_load(tiny_model_dir, fit_data, tmp_path, make_plugin, caplog):
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.fit.local import fit

    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(make_plugin("rlhf_broken_plugin", register_rewards=lambda register: 1 / 0))
    plugins.registries()
    fit(FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(fit_data / "sft.jsonl")], "objective": "sft",
                             "batch_size": 4, "steps": 1, "threads": 1, "out": str(tmp_path / "run"),
                             "progress": False}), plugins=plugins)
    assert "some plugins failed to load (see `rlhf plugins list`): rlhf_broken_plugin" in caplog.text
