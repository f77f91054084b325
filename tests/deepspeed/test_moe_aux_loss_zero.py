"""``--aux-loss-coef`` under the ``deepspeed`` backend (CPU, one process): ZeRO-2 and ZeRO-3 (whose
forwards gather partitioned weights, the router's among them) log the torch backend's aux loss and
loss, step for step."""

from __future__ import annotations

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.helpers import read_jsonl, run_cli

pytestmark = [pytest.mark.cluster, pytest.mark.deepspeed]


def _sft(plugins, moe_dir, tiny_model_dir, fit_data, out, *backend):
    result = run_cli(plugins, ["sft", "--model", str(moe_dir), "--tokenizer", str(tiny_model_dir),
                               "--data", str(fit_data / "sft.jsonl"), "--batch-size", "4", "--micro-batch-size", "2",
                               "--steps", "2", "--lr", "1e-3", "--aux-loss-coef", "0.5", "--out", str(out),
                               "--no-progress", *backend])
    assert result.exit_code == 0, result.output
    return read_jsonl(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def torch_metrics(moe_dir, tiny_model_dir, fit_data, tmp_path_factory):
    """The torch backend's metrics: every stage's reference, run once."""
    return _sft(build_plugin_manager(load_entrypoints=False), moe_dir, tiny_model_dir, fit_data,
                tmp_path_factory.mktemp("torch") / "run")


@pytest.mark.parametrize("stage", ["2", "3"])
def test_zero_stages_add_the_torch_backend_s_aux_loss(stage, plugins, moe_dir, tiny_model_dir, fit_data, tmp_path,
                                                      torch_metrics):
    expected = torch_metrics
    got = _sft(plugins, moe_dir, tiny_model_dir, fit_data, tmp_path / "ds", "--backend", "deepspeed",
               "--zero-stage", stage)
    assert len(got) == len(expected) == 2
    for mine, theirs in zip(got, expected):
        assert theirs["train/aux_loss"] > 0
        for key in ("train/aux_loss", "train/loss", "train/grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (mine["step"], key)
