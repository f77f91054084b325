"""tokens.jsonl under ``--runtime ray``: the driver's trainer writes the first ``--log-tokens N``
samples' tokens of each step as the local runtime does, and ``rlhf view`` opens them. The policy
lives in actors there, so a plain GRPO run's ``logprobs`` column may be missing (docs/runs.md,
"What runs record for it"); ids, pieces, mask and advantages are always there."""

from __future__ import annotations

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.token_log import expand
from rlhf.viewer.runs import open_runs
from tests.helpers import read_jsonl
from tests.ray.runs import make_config

pytestmark = [pytest.mark.cluster, pytest.mark.ray]


def test_a_ray_run_records_tokens_the_viewer_opens(ray_cluster, tiny_model_dir, task, tmp_path):
    from rlhf.runtime.ray import train

    out = tmp_path / "ray"
    train(make_config(tiny_model_dir, task, out, runtime="ray", log_tokens=3), plugins=build_plugin_manager())

    records = read_jsonl(out / "tokens.jsonl")
    samples = read_jsonl(out / "samples.jsonl")
    assert [(r["step"], r["sample"]) for r in records] == [(s, i) for s in (1, 2) for i in range(3)]
    for record in records:
        sample = [s for s in samples if s["step"] == record["step"]][record["sample"]]
        n = len(record["ids"])
        assert n > 0 and record["group"] == sample["group"] and sum(record["mask"]) == sample["completion_tokens"]
        for column in ("pieces", "mask", "advantages", "rollout_logprobs"):  # the engine's: asked for where free
            assert len(record[column]) == n, column
        for column in ("logprobs", "kl"):  # where recorded (the policy is in actors; no reference here), a value a token
            assert column not in record or len(record[column]) == n, column
        assert expand(record["origins"]) == ["model" if m else "env" for m in record["mask"]]
        assert "".join(record["pieces"]).startswith(sample["completion"][:3])

    [opened] = open_runs([out])
    assert opened.steps() == [1, 2] and opened.summary()["has_tokens"]
    for step in (1, 2):
        shown = opened.step(step)
        assert len(shown["samples"]) == 4 and sorted(shown["tokens"]) == ["0", "1", "2"]
        assert shown["tokens"]["2"]["ids"] == records[3 * (step - 1) + 2]["ids"]
