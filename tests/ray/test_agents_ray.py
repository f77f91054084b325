"""``--agent`` beyond one process (docs/agents.md, "Where it runs"): under ``--runtime ray`` the endpoint
and the agent calls live in the rollout actor, under torchrun in every rank, each serving the
trajectories of its share of the prompts. Through the real CLI: the calculator agent's tool calls on
Ray are recorded and trained exactly as in the local run (samples.jsonl, tokens.jsonl, metrics);
failed calls keep their outcomes under ``--on-failure mask`` and retry to the local run's samples;
``--async`` with segments equals the local ``--async`` run; and two torchrun ranks equal two Ray
rollout actors (the same seeds, rank r and actor r), each process with an endpoint of its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.token_log import expand
from tests.helpers import ROOT, one_thread, read_jsonl, run_cli, torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.ray]

pytest.importorskip("openai")

AGENTS = ROOT / "tests" / "agents" / "agents.py"
CALC = ROOT / "examples" / "agents"
RAY = ["--runtime", "ray", "--policy-cpus", "0.5", "--ref-cpus", "0.5", "--rollout-cpus", "0.5"]


def train(*args: str) -> None:
    """``rlhf train ARGS --no-progress`` in this process (on the session's cluster with ``--runtime ray``)."""
    result = run_cli(build_plugin_manager(), ["train", *args, "--no-progress"])
    assert result.exit_code == 0, result.output


def train_both(tmp_path: Path, *args: str) -> tuple[Path, Path]:
    """The same run with the Ray runtime and the local one; their run directories."""
    ray, local = tmp_path / "ray", tmp_path / "local"
    train(*args, *RAY, "--out", str(ray))
    with one_thread():  # as each actor has one
        train(*args, "--out", str(local))
    return ray, local


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "async/idle", "async/wait"))
             and "per_s" not in k} for row in rows]


def assert_same_run(one: Path, other: Path) -> None:
    """The same samples (tokens, origins, versions, outcomes, rewards) and the same metrics up to float
    round-off (two processes sum in another order than one)."""
    assert read_jsonl(one / "samples.jsonl") == read_jsonl(other / "samples.jsonl")
    rows, expected = comparable(read_jsonl(one / "metrics.jsonl")), comparable(read_jsonl(other / "metrics.jsonl"))
    assert [row.keys() for row in rows] == [row.keys() for row in expected]
    for row, want in zip(rows, expected):
        assert row == pytest.approx(want, rel=1e-5, abs=1e-8), row["step"]


def test_an_agent_calling_its_tool_on_ray_records_and_trains_exactly_as_the_local_run(tmp_path):
    ray, local = train_both(
        tmp_path, "--algo", "grpo", "--model", str(CALC / "calc-model"), "--data", str(CALC / "data" / "train.jsonl"),
        "--input-key", "prompt", "--agent", f"{CALC / 'calc.py'}:solve", "--n-samples", "4", "--prompts-per-step",
        "2", "--max-new-tokens", "16", "--lr", "1e-3", "--steps", "2", "--seed", "0", "--log-tokens", "8")
    assert_same_run(ray, local)
    # the same tokens, masks and columns (the local run adds the policy's log-probs, which on Ray live in
    # the policy actors: docs/runs.md)
    assert [{k: v for k, v in r.items() if k != "logprobs"} for r in read_jsonl(local / "tokens.jsonl")] == \
        read_jsonl(ray / "tokens.jsonl")

    samples = read_jsonl(ray / "samples.jsonl")
    assert len(samples) == 16 and all(s["outcome"] == "ok" for s in samples)
    called = [s for s in samples if any(o == "tool" for o, _ in s["token_origins"])]
    assert called, "some trajectory called the tool (in the rollout actor)"
    for sample in samples:
        origins = expand(sample["token_origins"])
        assert origins.count("model") == sample["completion_tokens"]
        versions = expand(sample["token_versions"])  # from the first model token on
        assert [v >= 0 for v in versions] == [o == "model" for o in origins[-len(versions):]]
        assert {v for v in versions if v >= 0} == {sample["step"] - 1}
    for sample in called:  # the tool's answer came back as a tool message and the model answered after it
        origins = [o for o, _ in sample["token_origins"]]
        assert origins.index("tool") < len(origins) - 1 - origins[::-1].index("model")
    records = read_jsonl(ray / "tokens.jsonl")
    assert len(records) == 16
    for record in records:  # every completion token: trained exactly where the policy sampled it
        origins, versions = expand(record["origins"]), expand(record["versions"])
        assert len(origins) == len(versions) == len(record["mask"]) == len(record["ids"])
        assert record["mask"] == [int(o == "model") for o in origins]
        assert versions == [record["step"] - 1 if m else -1 for m in record["mask"]]
    assert any("tool" in expand(r["origins"]) for r in records)
    metrics = read_jsonl(ray / "metrics.jsonl")
    assert [m["agent/failure_rate"] for m in metrics] == [0.0, 0.0]
    assert max(m["agent/requests_mean"] for m in metrics) > 1.0


def test_failed_agent_calls_on_ray_keep_their_outcomes_and_mask_nothing_else(tmp_path):
    """``fails_sometimes`` raises on a prompt whose first number is even and hangs on one ending in 5:
    under ``mask`` those samples stay with outcome and error, trained nowhere."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("2+1=", "3+1=", "5+1=", "9+1=")))
    out = tmp_path / "run"
    train("--algo", "grpo", "--model", str(CALC / "calc-model"), "--data", str(data), "--input-key", "prompt",
          "--agent", f"{AGENTS}:fails_sometimes", "--agent.timeout-s", "2", "--n-samples", "2", "--prompts-per-step",
          "4", "--max-new-tokens", "3", "--steps", "1", "--on-failure", "mask", "--log-tokens", "8", "--seed", "3",
          *RAY, "--out", str(out))
    samples = read_jsonl(out / "samples.jsonl")
    outcomes = {}
    for sample in samples:
        outcomes.setdefault(sample["prompt"].split("user\n")[1].split("<|im_end|>")[0], []).append(
            (sample["outcome"], sample["error"]))
    assert outcomes["2+1="] == [("agent_error", "ValueError: the tool crashed on 2")] * 2
    assert outcomes["5+1="] == [("timeout", f"the agent '{AGENTS}:fails_sometimes' took longer than --agent.timeout-s "
                                            "(2 s)")] * 2
    assert outcomes["3+1="] == outcomes["9+1="] == [("ok", None)] * 2
    (metrics,) = read_jsonl(out / "metrics.jsonl")
    assert metrics["agent/failure_rate"] == 0.5
    assert metrics["outcome/agent_error_rate"] == metrics["outcome/timeout_rate"] == 0.25
    for record, sample in zip(read_jsonl(out / "tokens.jsonl"), samples):
        assert (sum(record["mask"]) > 0) == (sample["outcome"] == "ok")  # a failed call trains no token


def test_retried_agent_calls_on_ray_sample_what_the_local_run_samples(tmp_path):
    """Under ``retry`` a failed sample is drawn again from a seed of its own inside the rollout actor, so
    the actor's stream, and with it the next step's samples, stay the local run's."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "2+1="}\n{"prompt": "3+1="}\n')
    ray, local = train_both(
        tmp_path, "--algo", "grpo", "--model", str(CALC / "calc-model"), "--data", str(data), "--input-key", "prompt",
        "--agent", f"{AGENTS}:fails_sometimes", "--n-samples", "2", "--prompts-per-step", "2", "--max-new-tokens",
        "3", "--steps", "2", "--on-failure", "retry", "--max-retries", "1", "--seed", "3")
    assert_same_run(ray, local)
    assert [m["outcome/retries"] for m in read_jsonl(ray / "metrics.jsonl")] == [2.0, 2.0]


def test_an_async_agent_run_with_segments_on_ray_equals_the_local_async_run(tiny_model_dir, task, tmp_path):
    """--async --max-staleness 1: the rollout actor's copy serves each batch's agents with its version;
    segments, token versions, behaviour log-probs (the losses) as in the local run."""
    ray, local = train_both(
        tmp_path, "--algo", "grpo", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
        "--input-key", "prompt", "--agent", f"{AGENTS}:branches", "--n-samples", "2", "--prompts-per-step", "2",
        "--max-new-tokens", "4", "--steps", "3", "--seed", "3", "--async", "--max-staleness", "1")
    assert_same_run(ray, local)
    metrics = read_jsonl(ray / "metrics.jsonl")
    assert [m["agent/segment_rows"] for m in metrics] == [4.0, 4.0, 4.0]
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 1]
    for sample in read_jsonl(ray / "samples.jsonl"):
        (segment,) = sample["segments"]
        for row in (sample, segment):
            assert {v for v in expand(row["token_versions"]) if v >= 0} == {max(0, sample["step"] - 2)}


def test_two_torchrun_ranks_serve_their_agents_as_two_ray_rollout_actors(tiny_model_dir, tmp_path):
    """Rank r and rollout actor r take prompts r, r + 2, ... and sample from seed + r: the same samples
    and (up to float round-off) metrics; each of the two processes served its agents through an
    endpoint of its own."""
    where = {name: tmp_path / f"{name}.where" for name in ("torchrun", "ray")}
    data = {name: tmp_path / f"{name}.jsonl" for name in where}
    for name, path in data.items():
        path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "where": str(where[name])}) + "\n"
                                for i in range(8)))
    args = ["--algo", "grpo", "--model", str(tiny_model_dir), "--input-key", "prompt", "--agent",
            f"{AGENTS}:solve_noting_where", "--n-samples", "2", "--prompts-per-step", "4", "--max-new-tokens", "4",
            "--micro-batch-size", "2", "--steps", "2", "--seed", "3"]
    torchrun(2, "-m", "rlhf", "train", *args, "--data", str(data["torchrun"]), "--no-progress", "--out",
             str(tmp_path / "torchrun"))
    train(*args, "--data", str(data["ray"]), "--runtime", "ray", "--policy-actors", "2", "--rollout-workers", "2",
          "--policy-cpus", "0.25", "--ref-cpus", "0.25", "--rollout-cpus", "0.25", "--out", str(tmp_path / "ray"))
    assert_same_run(tmp_path / "ray", tmp_path / "torchrun")
    for name, path in where.items():
        served = [tuple(map(int, line.split())) for line in path.read_text().splitlines()]
        assert len(served) == 16, name  # every call noted once
        ports: dict[int, set[int]] = {}
        for pid, port in served:
            ports.setdefault(pid, set()).add(port)
        assert len(ports) == 2 and os.getpid() not in ports, name  # two processes, neither this one
        assert all(len(p) == 1 for p in ports.values()) and len(set.union(*ports.values())) == 2, name
