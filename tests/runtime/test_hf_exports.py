"""``--save-hf-every N`` (rlhf/runtime/run/checkpoint.py, lifecycle.py): every N steps the trained model
as ``final/`` is written, in ``checkpoints/step_N/hf`` (the critic in ``hf_critic``), loadable with
``from_pretrained``; inside the step's checkpoint when one is due, else in an HF-only folder that
``--resume`` never takes for a checkpoint; pruned by ``--keep-checkpoints`` with the checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf.core.checkpoints import read_weight
from rlhf.runtime.run import checkpoint
from tests.helpers import final_weights, run_cli, torchrun


def train_args(model, task, out, *extra):
    return ["train", "--model", str(model), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(task / "rewards.py"), "--prompts-per-step", "2", "--n-samples", "2",
            "--max-new-tokens", "3", "--micro-batch-size", "2", "--lr", "1e-3", "--out", str(out), "--no-progress",
            *extra]


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def steps(out: Path) -> dict[str, list[str]]:
    """Each step folder's top-level entries."""
    root = out / "checkpoints"
    return {p.name: sorted(q.name for q in p.iterdir()) for p in sorted(root.iterdir()) if p.is_dir()}


@pytest.mark.run
def test_train_writes_hf_exports_that_load_and_hold_the_policy_and_critic_of_their_step(tiny_model_dir, task,
                                                                                       tmp_path, plugins):
    from transformers import AutoTokenizer, GenerationConfig

    out = tmp_path / "run"
    result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "4", "--save-every", "2",
                                         "--save-hf-every", "2", "--keep-checkpoints", "0", "--algo", "ppo",
                                         "--save-critic"))
    assert result.exit_code == 0, result.output
    for step in ("step_2", "step_4"):
        folder = out / "checkpoints" / step
        assert {"hf", "hf_critic", "policy", "critic", "trainer_state.json"} <= set(steps(out)[step])
        # the checkpoint's manifest covers its exports (one atomic write)
        listed = json.loads((folder / checkpoint.MANIFEST).read_text())["files"]
        assert "hf/config.json" in listed and "hf_critic/config.json" in listed
        assert checkpoint.manifest_problem(folder) is None
        # the policy at that step, exactly: the checkpoint's own copy of its weights
        state = checkpoint.load_tensors(folder / "policy" / "state.pt")["model"]
        assert_same(hf_weights(folder / "hf"), state)
        assert AutoTokenizer.from_pretrained(folder / "hf").pad_token_id is not None
        GenerationConfig.from_pretrained(folder / "hf")  # as final/ has it
        assert (folder / "hf" / "prompt_format.json").is_file()
        # the critic as --save-critic writes it: backbone + value head; its weights are the checkpoint's
        critic_state = checkpoint.load_tensors(folder / "critic" / "state.pt")["model"]
        heads = [k for k in critic_state if k.endswith("score.weight") and "backbone" not in k]
        assert len(heads) == 1, list(critic_state)
        assert torch.equal(read_weight(folder / "hf_critic", "score.weight"), critic_state[heads[0]])
    assert_same(hf_weights(out / "checkpoints" / "step_4" / "hf"), final_weights(out))
    assert (out / "checkpoints" / "step_4" / "hf_critic" / "model.safetensors").read_bytes() == (
        out / "critic" / "model.safetensors").read_bytes()
    assert not torch.equal(hf_weights(out / "checkpoints" / "step_2" / "hf")["lm_head.weight"],
                           final_weights(out)["lm_head.weight"])  # two steps apart: trained in between


@pytest.mark.run
def test_hf_only_folders_are_pruned_by_the_keep_count_and_never_resumed_from(tiny_model_dir, task, tmp_path,
                                                                             plugins, caplog):
    """--save-every 3 --save-hf-every 2 --keep-checkpoints 1 over 5 steps: HF exports at 2 and 4 in
    folders of their own, checkpoints at 3 and 5 (the last step); one of each kind is kept."""
    out = tmp_path / "run"
    args = train_args(tiny_model_dir, task, out, "--steps", "5", "--save-every", "3", "--save-hf-every", "2",
                      "--keep-checkpoints", "1")
    result = run_cli(plugins, args)
    assert result.exit_code == 0, result.output
    assert steps(out) == {"step_4": ["MANIFEST.json", "hf"],
                          "step_5": ["MANIFEST.json", "policy", "rng_0.pt", "trainer_state.json"]}
    assert checkpoint.list_checkpoints(out) == [out / "checkpoints" / "step_5"]
    assert checkpoint.manifest_problem(out / "checkpoints" / "step_4") is None
    hf_weights(out / "checkpoints" / "step_4" / "hf")  # loads

    # A run that stopped after step 4 (its step-5 checkpoint and final/ gone): --resume takes step_3,
    # the checkpoint, not the newer HF-only step_4, and finishes exactly like the run that did not stop.
    again = tmp_path / "again"
    keep_all = train_args(tiny_model_dir, task, again, "--steps", "5", "--save-every", "3", "--save-hf-every", "2",
                          "--keep-checkpoints", "0")
    assert run_cli(plugins, keep_all).exit_code == 0
    step_4 = hf_weights(again / "checkpoints" / "step_4" / "hf")
    import shutil

    shutil.rmtree(again / "checkpoints" / "step_5")
    shutil.rmtree(again / "final")
    assert checkpoint.latest_checkpoint(again) == again / "checkpoints" / "step_3"
    resumed = run_cli(plugins, [*keep_all, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from checkpoints/step_3 (step 3)" in caplog.text
    assert_same(final_weights(again), final_weights(out))
    assert_same(hf_weights(again / "checkpoints" / "step_4" / "hf"), step_4)  # written again, the same
    assert list(steps(again)) == ["step_2", "step_3", "step_4", "step_5"]


@pytest.mark.run
def test_sft_writes_hf_exports_between_checkpoints(tiny_model_dir, tmp_path, plugins):
    rows = "".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n" for a in range(4))
    (tmp_path / "sft.jsonl").write_text(rows)
    out = tmp_path / "run"
    result = run_cli(plugins, ["sft", "--model", str(tiny_model_dir), "--data", str(tmp_path / "sft.jsonl"),
                               "--batch-size", "2", "--steps", "4", "--save-hf-every", "2", "--out", str(out),
                               "--no-progress"])
    assert result.exit_code == 0, result.output
    assert steps(out) == {"step_2": ["MANIFEST.json", "hf"],
                          "step_4": ["MANIFEST.json", "hf", "model", "rng_0.pt", "trainer_state.json"]}
    assert_same(hf_weights(out / "checkpoints" / "step_4" / "hf"), final_weights(out))
    step_2 = hf_weights(out / "checkpoints" / "step_2" / "hf")
    assert not torch.equal(step_2["lm_head.weight"], final_weights(out)["lm_head.weight"])


@pytest.mark.run
def test_save_hf_every_may_change_on_resume(tiny_model_dir, task, tmp_path, plugins):
    """It changes what a run writes, not what it trains (run_dir.RESUME_FREE)."""
    out = tmp_path / "run"
    assert run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "1")).exit_code == 0
    result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "2", "--resume", "--resume-override",
                                         "steps", "--save-hf-every", "1"))
    assert result.exit_code == 0, result.output
    assert set(steps(out)["step_2"]) >= {"hf", "policy"}


@pytest.mark.run
def test_with_lora_hf_is_the_adapter_as_in_final_and_merge_lora_adds_the_merged_model(tiny_model_dir, tmp_path,
                                                                                     plugins):
    from transformers import AutoModelForCausalLM

    rows = "".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n" for a in range(4))
    (tmp_path / "sft.jsonl").write_text(rows)
    out = tmp_path / "run"
    result = run_cli(plugins, ["sft", "--model", str(tiny_model_dir), "--data", str(tmp_path / "sft.jsonl"),
                               "--batch-size", "2", "--steps", "2", "--save-hf-every", "2", "--lora-rank", "4",
                               "--merge-lora", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    hf = out / "checkpoints" / "step_2" / "hf"
    assert (hf / "adapter_config.json").is_file() and (hf / "adapter_model.safetensors").is_file()
    assert (hf / "adapter_model.safetensors").read_bytes() == (out / "final" / "adapter_model.safetensors").read_bytes()
    assert_same(hf_weights(hf / "merged"), hf_weights(out / "final" / "merged"))
    # transformers loads the adapter folder itself too (base + adapter, through peft)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        adapted = AutoModelForCausalLM.from_pretrained(hf)(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(hf / "merged")(ids).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)


@pytest.mark.unit
def test_a_save_hf_every_below_minus_one_is_a_usage_error(task, tmp_path, plugins):
    """-1 is OpenRLHF's "never", as 0 is (tests/runtime/test_new_user_runs.py); below it is refused."""
    result = run_cli(plugins, train_args(tmp_path / "not-loaded", task, tmp_path / "run", "--save-hf-every", "-2"))
    assert result.exit_code == 2 and "--save-hf-every must be a number of steps, or 0 or -1 (never); got -2" in (
        result.output), result.output


@pytest.mark.cluster
def test_hf_exports_under_torchrun_with_two_processes(tiny_model_dir, tmp_path):
    """Every rank takes part in each export (and its HF-only folder's write); the main rank writes."""
    rows = "".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n" for a in range(8))
    (tmp_path / "sft.jsonl").write_text(rows)
    out = tmp_path / "run"
    torchrun(2, "-m", "rlhf", "sft", "--model", str(tiny_model_dir), "--data", str(tmp_path / "sft.jsonl"),
             "--batch-size", "4", "--steps", "2", "--save-hf-every", "1", "--out", str(out), "--no-progress")
    assert steps(out) == {"step_1": ["MANIFEST.json", "hf"],
                          "step_2": ["MANIFEST.json", "hf", "model", "rng_0.pt", "rng_1.pt", "trainer_state.json"]}
    assert_same(hf_weights(out / "checkpoints" / "step_2" / "hf"), final_weights(out))
    hf_weights(out / "checkpoints" / "step_1" / "hf")
