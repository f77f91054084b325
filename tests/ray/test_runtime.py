"""`rlhf train --runtime ray` on a local CPU cluster: it reproduces the local run, two data-parallel
policy actors update like one, workers with other plugins are refused, a killed worker stops the
run with a message naming it and a resumable checkpoint, and nothing is left running."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import rlhf
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.rl.local import train as local_train
from tests.helpers import one_thread, read_jsonl, write_task
from tests.ray.runs import (TRAINING_KEYS, actor_processes, assert_same_training, final_weights, make_config,
                            ray_processes, samples)

pytestmark = [pytest.mark.cluster, pytest.mark.ray]

ENV = '''\
from rlhf.core.types import StepResult


class LengthEnv:
    """One turn; 0.05 per character of the answer."""

    def reset(self, prompt, label):
        return None

    def step(self, action):
        return StepResult(reward=0.05 * len(action), done=True)
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = write_task(tmp_path_factory.mktemp("task"))
    (root / "envs.py").write_text(ENV)
    return root


def ray_train(config, plugins=None):
    from rlhf.runtime.ray import train

    return train(config, plugins=plugins or build_plugin_manager())


def assert_no_actors_left(timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while actor_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert actor_processes() == [], "Ray actor processes outlived the run"
    import ray

    assert [n for n in ray.util.list_named_actors() if n.startswith("rlhf-")] == []


def test_the_ray_runtime_reproduces_the_local_run(ray_cluster, tiny_model_dir, task, tmp_path):
    """One policy actor, one reference actor, one rollout actor holding its own copy of the policy:
    the same samples, rewards and losses as the local runtime, weights synced every step."""
    with one_thread():
        local_train(make_config(tiny_model_dir, task, tmp_path / "local", save_every=1),
                    plugins=build_plugin_manager())
    ray_out = tmp_path / "ray"
    assert ray_train(make_config(tiny_model_dir, task, ray_out, save_every=1, runtime="ray")) == ray_out
    assert_no_actors_left()

    assert_same_training(ray_out, tmp_path / "local")
    metrics = read_jsonl(ray_out / "metrics.jsonl")
    assert all(m["time/sync"] > 0 for m in metrics)  # the rollout actor's copy was refreshed every step
    assert metrics[1]["policy/loss"] != metrics[0]["policy/loss"]  # the second step sampled from new weights
    step = ray_out / "checkpoints" / "step_2"
    assert sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file()) == [
        "MANIFEST.json", "policy/rng_0.pt", "policy/state.pt", "rng_0.pt", "rollout/rng_0.pt", "trainer_state.json"]
    for (name, a), b in zip(final_weights(tmp_path / "local").items(), final_weights(ray_out).values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_on_policy_distillation_on_ray_reproduces_the_local_run(ray_cluster, tiny_model_dir, fit_teacher, task,
                                                                tmp_path):
    """--algo opd --teacher: the teacher in an actor of its own (the reference's place), then colocated
    with the policy: the same samples, teacher log-probs and losses as the local runtime."""
    opd = dict(algo="opd", teacher=str(fit_teacher), teacher_coef=0.5)
    with one_thread():
        local_train(make_config(tiny_model_dir, task, tmp_path / "local", **opd), plugins=build_plugin_manager())
    keys = TRAINING_KEYS[:-1] + ("teacher/reverse_kl",)  # no KL term
    for colocate in ("none", "policy_ref"):
        ray_out = tmp_path / f"ray-{colocate}"
        ray_train(make_config(tiny_model_dir, task, ray_out, runtime="ray", colocate=[colocate], **opd))
        assert_no_actors_left()
        assert_same_training(ray_out, tmp_path / "local", keys=keys)


def test_a_ppo_run_with_a_critic_actor_reproduces_the_local_run(ray_cluster, tiny_model_dir, task, tmp_path):
    """PPO: the critic's value head is initialised in its own actor, and the rollout actor builds no
    critic; both still draw what the local process draws (issue 19: step-1 rewards differed)."""
    ppo = dict(algo="ppo", critic_cpus=0.25, policy_cpus=0.5, ref_cpus=0.25, rollout_cpus=0.5)
    with one_thread():
        local_train(make_config(tiny_model_dir, task, tmp_path / "local", **ppo), plugins=build_plugin_manager())
    ray_out = tmp_path / "ray"
    ray_train(make_config(tiny_model_dir, task, ray_out, runtime="ray", **ppo))
    assert_no_actors_left()
    assert_same_training(ray_out, tmp_path / "local", keys=TRAINING_KEYS + ("critic/loss",))


def test_ppo_with_both_pairs_colocated_reproduces_the_local_run(ray_cluster, tiny_model_dir, task, tmp_path, caplog):
    """--colocate policy_ref --colocate critic_reward: one policy+reference actor, one critic actor that
    also scores the rewards, one rollout actor; the same samples, rewards, losses and weights as the
    local run."""
    ppo = dict(algo="ppo", policy_cpus=0.5, critic_cpus=0.5, rollout_cpus=0.5)
    with one_thread():
        local_train(make_config(tiny_model_dir, task, tmp_path / "local", **ppo), plugins=build_plugin_manager())
    ray_out = tmp_path / "ray"
    with caplog.at_level("INFO", logger="rlhf.runtime.ray.driver"):
        ray_train(make_config(tiny_model_dir, task, ray_out, runtime="ray", colocate=["policy_ref", "critic_reward"],
                              **ppo))
    assert_no_actors_left()
    ready = next(r.getMessage() for r in caplog.records if "Ray runtime ready" in r.getMessage())
    assert ready.endswith("policy+reference ×1 (0.5 CPU, 0 GPU each), critic+reward ×1 (0.5 CPU, 0 GPU each), "
                          "rollout ×1 (0.5 CPU, 0 GPU each)"), ready
    assert_same_training(ray_out, tmp_path / "local", keys=TRAINING_KEYS + ("critic/loss",))
    assert read_jsonl(ray_out / "metrics.jsonl")[-1]["kl/mean"] != 0  # the reference ran, in the policy's actor
    for (name, a), b in zip(final_weights(tmp_path / "local").items(), final_weights(ray_out).values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_save_hf_every_on_ray_writes_the_policy_and_critic_of_each_step(ray_cluster, tiny_model_dir, task, tmp_path):
    """--save-hf-every under Ray: the actors write step_N/hf and hf_critic into the driver's checkpoint
    folder, the policy's weights those of the step's checkpoint, the last one final/."""
    from transformers import AutoModelForCausalLM

    from rlhf.core.checkpoints import read_weight
    from rlhf.runtime.run import checkpoint

    ppo = dict(algo="ppo", critic_cpus=0.25, policy_cpus=0.5, ref_cpus=0.25, rollout_cpus=0.5)
    out = tmp_path / "ray"
    ray_train(make_config(tiny_model_dir, task, out, runtime="ray", save_every=1, save_hf_every=1, save_critic=True,
                          **ppo))
    assert_no_actors_left()
    for step in ("step_1", "step_2"):
        folder = out / "checkpoints" / step
        assert checkpoint.manifest_problem(folder) is None
        hf = AutoModelForCausalLM.from_pretrained(folder / "hf").state_dict()
        state = checkpoint.load_tensors(folder / "policy" / "state.pt")["model"]
        assert hf.keys() == state.keys() and all(torch.equal(hf[k], state[k]) for k in state), step
        assert read_weight(folder / "hf_critic", "score.weight").shape == (1, 64)
    last = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_2" / "hf").state_dict()
    assert all(torch.equal(last[k], v) for k, v in final_weights(out).items())


@pytest.mark.deepspeed
def test_deepspeed_zero3_over_two_policy_actors_reproduces_the_local_torch_run(ray_cluster, tiny_model_dir, task,
                                                                                 tmp_path):
    """One DeepSpeed rank per policy actor: ZeRO-3 shards the policy over the two actors, the
    rollout actor's copy gets the gathered weights after each step, the final model is consolidated."""
    pytest.importorskip("deepspeed")
    with one_thread():
        local_train(make_config(tiny_model_dir, task, tmp_path / "local", kl_coef=0.0),
                    plugins=build_plugin_manager())
    ray_out = tmp_path / "ray"
    ray_train(make_config(tiny_model_dir, task, ray_out, kl_coef=0.0, runtime="ray", backend="deepspeed",
                          zero_stage=3, policy_actors=2))
    assert_no_actors_left()
    # Two ranks sum floats in another order: a GRPO loss that is 0 up to round-off (~1e-7) differs there.
    assert_same_training(ray_out, tmp_path / "local", keys=[k for k in TRAINING_KEYS if k != "kl/mean"], abs_tol=1e-6)
    shards = sorted(p.name for p in (ray_out / "checkpoints" / "step_2" / "policy" / "deepspeed").iterdir())
    assert shards == [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
    for (name, a), b in zip(final_weights(tmp_path / "local").items(), final_weights(ray_out).values()):
        assert torch.allclose(a, b, atol=1e-5), name


def fixed_batch():
    """8 trajectories (4 prompts x 2) of different lengths, with GRPO advantages."""
    from rlhf.algorithms import compute_advantages, resolve_algorithm
    from rlhf.core.types import Trajectory
    from rlhf.core.batch import collate

    generator = torch.Generator().manual_seed(1)
    trajectories = []
    for row in range(8):
        prompt = torch.randint(5, 300, (3 + row % 3,), generator=generator).tolist()
        completion = torch.randint(5, 300, (2 + row % 4,), generator=generator).tolist()
        mask = [0] * len(prompt) + [1] * len(completion)
        trajectories.append(Trajectory(token_ids=prompt + completion, loss_mask=mask, prompt_length=len(prompt),
                                       prompt="", prompt_text="", completion_text="", group=row // 2))
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.5])
    batch = collate(trajectories, pad_token_id=0, rewards=rewards, sample_mask=torch.ones(8))
    algorithm = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0)
    batch.advantages, batch.returns = compute_advantages(algorithm.advantage, rewards=batch.rewards,
                                                         action_mask=batch.action_mask, group_size=2)
    return batch


def test_two_policy_actors_update_the_policy_like_one(ray_cluster, tiny_model_dir, task, tmp_path):
    """Each actor trains every other row of each minibatch; token_mean normalises over the whole
    minibatch and gradients are summed over the actors (gloo), so the update is one actor's."""
    import dataclasses

    from rlhf.runtime.ray.cluster import Cluster
    from rlhf.runtime.ray.driver import launch
    from rlhf.runtime.ray.groups import PolicyGroup
    from rlhf.runtime.ray.placement import HostGroup, Layout, Resources

    config = make_config(tiny_model_dir, task, tmp_path / "run", kl_coef=0.0, prompts_per_step=4, n_samples=2,
                         train_batch_size=4, ppo_epochs=2, micro_batch_size=1, lr=1e-2, max_new_tokens=8, seed=3,
                         runtime="ray")
    half_cpu = Resources(0.5, 0.0)
    two_and_one = Layout((HostGroup(("policy",), 2, half_cpu), HostGroup(("policy",), 1, half_cpu)))
    cluster = Cluster.open(config, cpus_needed=1.5, gpus_needed=0, out_dir=tmp_path / "run")
    results = {}
    try:
        hosts = launch(two_and_one, config, 8, build_plugin_manager(), cluster)
        assert [(h.info["dist_rank"], h.info["world_size"]) for h in hosts] == [(0, 2), (1, 2), (0, 1)]
        assert hosts[0].info["pid"] != hosts[1].info["pid"]
        for name, group in (("two", PolicyGroup(hosts[:2], 120, hosts)), ("one", PolicyGroup(hosts[2:], 120, hosts))):
            batch = fixed_batch()
            batch = dataclasses.replace(batch, old_logprobs=group.logprobs(batch))  # (B, A) gathered over ranks
            metrics = group.fit(batch, step=0)
            results[name] = (batch.old_logprobs, metrics, group.state_dict()["model"])
    finally:
        cluster.close()
    assert_no_actors_left()

    (old_two, metrics_two, weights_two), (old_one, metrics_one, weights_one) = results["two"], results["one"]
    assert torch.allclose(old_two, old_one, atol=1e-6)
    assert metrics_two.keys() == metrics_one.keys() and "policy/loss" in metrics_one
    for key, value in metrics_one.items():
        assert metrics_two[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for name, weight in weights_one.items():
        assert torch.allclose(weight, weights_two[name], atol=2e-5), name  # float sums in another order
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    changed = sum(not torch.equal(start[name], weight) for name, weight in weights_one.items() if name in start)
    assert changed > 0, "the update changed nothing"


def test_workers_with_other_plugins_are_refused(ray_cluster, tiny_model_dir, task, tmp_path):
    config = make_config(tiny_model_dir, task, tmp_path / "run", runtime="ray", colocate="all",
                         ray_env=["RLHF_DISABLE_PLUGINS=rlhf.plugins.loggers.plugin"])
    from rlhf.runtime.ray.driver import PluginMismatchError

    with pytest.raises(PluginMismatchError) as caught:
        ray_train(config)
    message = str(caught.value)
    assert re.search(r"policy\+reference\+rollout\+reward rank 0 \[pid \d+ on node \S+ \(.*\)\]:\n"
                     r"    plugin 'rlhf\.plugins\.loggers\.plugin' \(rlhf-core==\S+\) is missing", message), message
    assert "RLHF_DISABLE_PLUGINS" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the run began
    assert_no_actors_left()


class RolloutKiller:
    """Kills the rollout actor's process (as the OOM killer would) right after the step-1 checkpoint."""

    @rlhf.hookimpl
    def on_checkpoint(self, step):
        if step != 1:
            return
        import ray

        names = ray.util.list_named_actors()
        name = next(n for n in names if n.startswith("rlhf-") and n.endswith("-rollout+reward-0"))
        os.kill(ray.get(ray.get_actor(name).hello.remote())["pid"], signal.SIGKILL)


def test_a_killed_worker_stops_the_run_and_resume_finishes_it(ray_cluster, tiny_model_dir, task, tmp_path):
    """The environment and the reward come from files the actors import; the resumed run restores
    the policy, its optimizer and the rollout actor's sampling RNG, so it matches an uninterrupted run."""
    out = tmp_path / "run"
    values = dict(steps=3, save_every=1, env=f"{task / 'envs.py'}:LengthEnv", colocate="policy_ref")
    plugins = build_plugin_manager()
    plugins.register(RolloutKiller(), "rollout_killer")
    from rlhf.runtime.ray.groups import WorkerDiedError

    with pytest.raises(WorkerDiedError) as caught:
        ray_train(make_config(tiny_model_dir, task, out, runtime="ray", **values), plugins=plugins)
    message = str(caught.value)
    assert re.match(r"rollout\+reward rank 0 \[pid \d+ on node \S+ \(.*\)\] died during rollout\.generate: \S",
                    message), message
    assert (f"The last complete checkpoint is {out / 'checkpoints' / 'step_1'} (after step 1): run the same command "
            "with --resume") in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1]
    assert_no_actors_left()

    ray_train(make_config(tiny_model_dir, task, out, runtime="ray", resume=True, **values))
    assert_no_actors_left()
    with one_thread():
        local_train(make_config(tiny_model_dir, task, tmp_path / "local", **values), plugins=build_plugin_manager())
    assert_same_training(out, tmp_path / "local")
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["env/reward_mean"] > 0 for m in metrics)  # LengthEnv ran in the rollout actor
    assert (out / "final" / "config.json").is_file()


def test_rlhf_train_on_ray_with_two_policy_actors_leaves_nothing_running(tiny_model_dir, task):
    """The command line starts its own cluster (relative paths resolve in the actors as in the
    driver's directory), trains with two policy and two rollout actors, and stops every process
    it started."""
    work = Path(tempfile.mkdtemp(prefix="rlhf-ray-"))  # short: Ray's socket paths live under RAY_TMPDIR
    try:
        run_in(work, tiny_model_dir, task)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_in(work, tiny_model_dir, task):
    for name in ("data.jsonl", "rewards.py"):
        (work / name).write_text((task / name).read_text())
    env = {**os.environ, "RAY_TMPDIR": str(work / "ray"), "RLHF_LOAD_PLUGINS": ""}
    args = ["--runtime", "ray", "--policy-actors", "2", "--colocate", "policy_ref", "--policy-cpus", "0.5",
            "--rollout-workers", "2", "--rollout-cpus", "0.5", "--model", str(tiny_model_dir),
            "--data", "data.jsonl", "--label-key", "answer", "--reward", "rewards.py:reward_func",
            "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "4", "--micro-batch-size", "2",
            "--steps", "2", "--lr", "1e-3", "--no-progress", "--out", "run"]
    result = subprocess.run([sys.executable, "-m", "rlhf", "train", *args], capture_output=True, text=True, env=env,
                            cwd=work, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "run finished: run" in result.stdout
    assert [m["step"] for m in read_jsonl(work / "run" / "metrics.jsonl")] == [1, 2]
    assert (work / "run" / "final" / "config.json").is_file()
    step = work / "run" / "checkpoints" / "step_2"
    assert sorted(p.name for p in (step / "policy").iterdir()) == ["rng_0.pt", "rng_1.pt", "state.pt"]  # 2 ranks
    assert sorted(p.name for p in (step / "rollout").iterdir()) == ["rng_0.pt", "rng_1.pt"]  # 2 rollout workers

    # The two rollout workers each sampled half the prompts; they come back in the loader's order, groups intact.
    from transformers import AutoTokenizer

    from rlhf.runtime.rl.local import build_loader

    loader = build_loader(TrainConfig.from_dict({"model": str(tiny_model_dir), "data": [str(work / "data.jsonl")],
                                                 "label_key": "answer"}), AutoTokenizer.from_pretrained(tiny_model_dir))
    expected = [item.prompt for _ in range(2) for item in loader.next_batch(2)]
    prompts = [s["prompt"] for s in read_jsonl(work / "run" / "samples.jsonl")]
    assert prompts[0::2] == prompts[1::2] == expected
    deadline = time.monotonic() + 30
    while ray_processes(str(work / "ray")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes(str(work / "ray")) == []  # raylet, GCS and workers of the run's cluster are gone


def test_eval_filtering_and_adaptive_kl_on_ray_match_the_local_run(ray_cluster, tiny_model_dir, task, tmp_path):
    """The RL loop's extensions run in the driver: the Ray runtime gives the local run's eval rows,
    filtered batches, β and best/."""
    extra = dict(eval_data=[str(task / "data.jsonl")], eval_max_samples=2, eval_every=1, save_best="eval/reward/mean",
                 filter_groups=True, max_filter_rounds=4, kl_target=0.01, kl_horizon=40)
    with one_thread():
        local_train(make_config(tiny_model_dir, task, tmp_path / "local", **extra), plugins=build_plugin_manager())
    ray_out = tmp_path / "ray"
    ray_train(make_config(tiny_model_dir, task, ray_out, runtime="ray", **extra))
    assert_no_actors_left()
    assert samples(ray_out) == samples(tmp_path / "local")
    rows = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("local", "ray")}
    assert [r["step"] for r in rows["ray"]] == [r["step"] for r in rows["local"]] == [0, 1, 1, 2, 2]
    for ray_row, local_row in zip(rows["ray"], rows["local"]):
        for key in ("eval/reward/mean", "reward/mean", "policy/loss", "kl/beta", "filter/kept_groups"):
            if key in local_row:
                assert ray_row[key] == pytest.approx(local_row[key], rel=1e-5, abs=1e-9), (local_row["step"], key)
    assert (ray_out / "best" / "best.json").read_text() == (tmp_path / "local" / "best" / "best.json").read_text()


def test_async_on_ray_generates_ahead_like_the_local_async_run(ray_cluster, tiny_model_dir, task, tmp_path):
    """--async on Ray: the rollout actor's copy generates batch s from version s - K (weights pushed by
    version through the object store): the same samples, staleness and losses as the local --async run."""
    extra = dict(async_rollout=True, max_staleness=1, steps=3, eval_data=[str(task / "data.jsonl")],
                 eval_max_samples=2, eval_every=2)
    with one_thread():
        local_train(make_config(tiny_model_dir, task, tmp_path / "local", **extra), plugins=build_plugin_manager())
    ray_out = tmp_path / "ray"
    ray_train(make_config(tiny_model_dir, task, ray_out, runtime="ray", **extra))
    assert_no_actors_left()
    assert not any(t.name == "rlhf-async-generation" for t in threading.enumerate())
    assert samples(ray_out) == samples(tmp_path / "local")
    rows = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("local", "ray")}
    assert [r.get("async/staleness_max") for r in rows["ray"] if "reward/mean" in r] == [0, 1, 1]
    for ray_row, local_row in zip(rows["ray"], rows["local"]):
        assert ray_row["step"] == local_row["step"]
        for key in ("eval/reward/mean", "reward/mean", "policy/loss", "policy/approx_kl", "async/version"):
            if key in local_row:
                assert ray_row[key] == pytest.approx(local_row[key], rel=1e-5, abs=1e-8), (local_row["step"], key)


def test_async_on_ray_resumes_exactly_with_batches_in_flight(ray_cluster, tiny_model_dir, task, tmp_path, make_plugin):
    extra = dict(async_rollout=True, max_staleness=1, steps=4, save_every=2, runtime="ray")
    straight = tmp_path / "straight"
    ray_train(make_config(tiny_model_dir, task, straight, **extra))

    def crash(step):
        if step == 2:
            raise KeyboardInterrupt

    plugins = build_plugin_manager()
    plugins.register(make_plugin("killer", on_checkpoint=crash))
    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        ray_train(make_config(tiny_model_dir, task, resumed, **extra), plugins=plugins)
    assert_no_actors_left()
    ray_train(make_config(tiny_model_dir, task, resumed, resume=True, **extra))
    assert samples(resumed) == samples(straight)
    for (name, a), b in zip(final_weights(straight).items(), final_weights(resumed).values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_async_on_ray_with_two_rollout_actors(ray_cluster, tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    ray_train(make_config(tiny_model_dir, task, out, runtime="ray", async_rollout=True, max_staleness=2, steps=3,
                          rollout_workers=2, rollout_cpus=0.25, prompts_per_step=4))
    assert_no_actors_left()
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 2]
    assert [m["async/version"] for m in metrics] == [0, 0, 0]
    assert len(read_jsonl(out / "samples.jsonl")) == 3 * 4 * 2
