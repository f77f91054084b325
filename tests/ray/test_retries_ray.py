"""``--on-failure retry`` (the default) under ``--runtime ray``, synchronous and ``--async`` (pipelined):
a failed sample is generated again from the seed the local runtime gives it (``retry_seed``), in
the rollout actor from a stream of its own (the actor's sampling stream left as it was); under
``--async`` with the weights of its batch's version, which the actor holds for that call only. So a
Ray run with retries is the local run: the same samples (the retried ones among them, ended ok),
outcome metrics and losses; and its advantages are RLOO's over the samples as they ended, by hand
from samples.jsonl and tokens.jsonl (docs/outcomes.md)."""

from __future__ import annotations

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.local import train as local_train
from tests.helpers import FLAKY_TOOL, one_thread, read_jsonl, write_jsonl
from tests.ray.runs import make_config, samples

pytestmark = [pytest.mark.cluster, pytest.mark.ray]


COMPARED = ("reward/mean", "policy/loss", "policy/approx_kl", "outcome/retries", "outcome/ok_rate",
            "outcome/truncated_rate", "outcome/env_error_rate", "outcome/dropped_groups")


@pytest.fixture(scope="module")
def flaky(tmp_path_factory):
    root = tmp_path_factory.mktemp("flaky")
    (root / "tools.py").write_text(FLAKY_TOOL)
    write_jsonl(root / "data.jsonl", [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)])
    return root


def config(model_dir, root, out, **overrides):
    return make_config(model_dir, root, out, reward=[], env=f"{root / 'tools.py'}:FlakyTool", n_samples=3,
                       micro_batch_size=3, advantage="rloo", log_tokens=6, steps=3, **overrides)


def ray_train(cfg):
    from rlhf.runtime.ray import train

    return train(cfg, plugins=build_plugin_manager())


def assert_rloo_by_hand(out):
    """Every policy token's advantage (tokens.jsonl) is its sample's reward minus the mean of its
    group's other rewards (samples.jsonl, every sample as it ended: retried ones with their new reward)."""
    rows, tokens = read_jsonl(out / "samples.jsonl"), read_jsonl(out / "tokens.jsonl")
    assert [(t["step"], t["sample"]) for t in tokens] == [(s, i) for s in (1, 2, 3) for i in range(6)]
    for record in tokens:
        step_rows = [r for r in rows if r["step"] == record["step"]]
        me = step_rows[record["sample"]]
        others = [r["reward"] for r in step_rows if r["group"] == me["group"] and r is not me]
        expected = me["reward"] - sum(others) / len(others)
        got = [a for a, m in zip(record["advantages"], record["mask"]) if m]
        assert got and all(abs(a - expected) < 1e-3 for a in got), (record["step"], record["sample"], got, expected)


def assert_same_run_with_retries(ray_out, local_out):
    metrics = read_jsonl(ray_out / "metrics.jsonl")
    assert sum(m["outcome/retries"] for m in metrics) > 0, "no sample failed: pick another seed"
    assert sum(m["outcome/dropped_groups"] for m in metrics) == 0  # each retry succeeded in time here
    rows = read_jsonl(ray_out / "samples.jsonl")
    assert len(rows) == 3 * 6 and all(r["outcome"] in ("ok", "truncated") and r["error"] is None for r in rows)
    # every sample kept passed the tool, the retried ones included (the tool fails on these texts only)
    assert all(sum(map(ord, r["completion"])) % 3 for r in rows)
    assert samples(ray_out) == samples(local_out)
    for ray_row, local_row in zip(metrics, read_jsonl(local_out / "metrics.jsonl")):
        for key in COMPARED:
            assert ray_row[key] == pytest.approx(local_row[key], rel=1e-5, abs=1e-8), (ray_row["step"], key)
    assert_rloo_by_hand(ray_out)


def test_a_synchronous_ray_run_retries_as_the_local_run_does(ray_cluster, tiny_model_dir, flaky, tmp_path):
    with one_thread():
        local_train(config(tiny_model_dir, flaky, tmp_path / "local"), plugins=build_plugin_manager())
    ray_train(config(tiny_model_dir, flaky, tmp_path / "ray", runtime="ray"))
    assert_same_run_with_retries(tmp_path / "ray", tmp_path / "local")


def test_a_pipelined_async_ray_run_retries_by_the_batch_version_as_the_local_run_does(ray_cluster, tiny_model_dir,
                                                                                      flaky, tmp_path):
    extra = dict(async_rollout=True, max_staleness=2)
    with one_thread():
        local_train(config(tiny_model_dir, flaky, tmp_path / "local", **extra), plugins=build_plugin_manager())
    for name in ("ray", "again"):
        ray_train(config(tiny_model_dir, flaky, tmp_path / name, runtime="ray", **extra))
    assert_same_run_with_retries(tmp_path / "ray", tmp_path / "local")
    metrics = read_jsonl(tmp_path / "ray" / "metrics.jsonl")
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 2]
    # the same command twice: the same samples and training, bit for bit
    assert read_jsonl(tmp_path / "again" / "samples.jsonl") == read_jsonl(tmp_path / "ray" / "samples.jsonl")
    untimed = [[{k: v for k, v in m.items() if not k.startswith(("time/", "perf/")) and not k.endswith("_s")
                 and "per_s" not in k} for m in read_jsonl(tmp_path / name / "metrics.jsonl")]
               for name in ("ray", "again")]
    assert untimed[0] == untimed[1]
