"""``rlhf train --engine vllm`` (the fake vLLM of tests/vllm/fakes.py) verifies every sync by default:
a normal run passes; a vLLM model that leaves one tensor stale after the first sync stops the run
with one line naming it, exit 1; ``--no-verify-weight-sync`` lets it through."""

from __future__ import annotations

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.helpers import run_cli
from tests.vllm import fakes

pytestmark = pytest.mark.run

STALE = "model.layers.0.mlp.gate_proj.weight"


def train(tiny_model_dir, task, out, *extra):
    return run_cli(build_plugin_manager(), [
        "train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--label-key", "answer",
        "--reward", str(task / "rewards.py"), "--engine", "vllm", "--steps", "3", "--prompts-per-step", "2",
        "--n-samples", "2", "--max-new-tokens", "4", "--micro-batch-size", "2", "--lr", "1e-2",
        "--out", str(out), "--no-progress", *extra])


@pytest.fixture
def stale_after_the_first_sync(monkeypatch):
    build = fakes.FakeModel.__init__

    def with_fault(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.drop = {STALE}

    monkeypatch.setattr(fakes.FakeModel, "__init__", with_fault)


def test_a_normal_run_passes_the_check(fake_vllm, tiny_model_dir, task, tmp_path):
    result = train(tiny_model_dir, task, tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "final").is_dir()
    assert len(fakes.FakeLLM.instances[0].worker.model.batches) >= 3  # synced after every step


def test_a_stale_tensor_stops_the_run_in_one_line(fake_vllm, stale_after_the_first_sync, tiny_model_dir, task,
                                                  tmp_path):
    result = train(tiny_model_dir, task, tmp_path / "run")
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert f"{STALE} was sent but vLLM's load_weights never loaded it" in errors[0]


def test_the_check_can_be_turned_off_on_the_command_line(fake_vllm, stale_after_the_first_sync, tiny_model_dir,
                                                         task, tmp_path):
    result = train(tiny_model_dir, task, tmp_path / "run", "--no-verify-weight-sync", "--weight-sync-timeout-s", "0")
    assert result.exit_code == 0, result.output
