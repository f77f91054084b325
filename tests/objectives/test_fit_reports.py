"""What the fit loop tells about its run: ``best/README.md`` names the metric that made it the best
model (``final/README.md`` does not), and the warning about sequences cut at ``--max-len`` counts
exactly those cut, in all and in ``--data``."""

from __future__ import annotations

import logging

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.helpers import write_jsonl

pytestmark = pytest.mark.run


def test_the_best_models_card_names_the_metric_and_the_final_ones_does_not(tiny_model_dir, fit_data, tmp_path):
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.fit.local import fit

    out = tmp_path / "run"
    fit(FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(fit_data / "sft.jsonl")],
                             "eval_data": [str(fit_data / "sft.jsonl")], "objective": "sft", "batch_size": 4,
                             "micro_batch_size": 4, "steps": 2, "eval_every": 1, "save_best": "eval/loss",
                             "out": str(out), "progress": False}), plugins=build_plugin_manager(load_entrypoints=False))
    assert (out / "best" / "README.md").read_text().splitlines()[0] == "# run: the best model by `eval/loss`"
    assert (out / "final" / "README.md").read_text().splitlines()[0] == "# run"


def test_the_truncation_warning_counts_the_sequences_cut(tiny_model_dir, tmp_path, caplog):
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.config.fit_plan import FitPlan
    from rlhf.runtime.fit.local import build_parts

    long = " ".join(["word"] * 40)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Q:", "response": long}] * 3 + [{"prompt": "Q:", "response": "a"}])
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "Q:", "response": long}] * 2)
    plugins = build_plugin_manager(load_entrypoints=False)
    config = FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(tmp_path / "train.jsonl")],
                                  "eval_data": [str(tmp_path / "eval.jsonl")], "objective": "sft", "max_len": 16,
                                  "batch_size": 2, "out": str(tmp_path / "run")})
    with caplog.at_level(logging.WARNING):
        parts, _ = build_parts(FitPlan.make(config, plugins))
    assert "5 sequence(s) were longer than --max-len 16 and lost the end of their response (3 in --data)" in caplog.text
    assert [len(ids) for ids, _ in parts.train_examples].count(16) == 3
