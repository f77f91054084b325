"""Where the Ray runtime places roles, what it ships to workers, and how worker failures read
(pure functions; the one Ray-backed test here uses the session cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf.core.errors import ConfigError
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.ray.cluster import job_runtime_env
from rlhf.runtime.ray.driver import worker_env
from rlhf.runtime.ray.groups import (Host, WorkerDiedError, WorkerFailedError, WorkerTimeoutError, death_cause,
                                     failure, wait)
from rlhf.runtime.ray.placement import plan_layout

pytestmark = pytest.mark.cluster


def config(**values):
    return TrainConfig.from_dict({"model": "m", "data": ["d.jsonl"], "reward": ["r.py"], **values})


def _task_files(folder: Path) -> tuple[str, str]:
    """A data file and a reward file that exist: the command line checks both before the runtime starts."""
    (folder / "d.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    (folder / "r.py").write_text("def reward(completion, label, **_):\n    return 0.0\n")
    return str(folder / "d.jsonl"), str(folder / "r.py")


def layout(values=None, *, reference=True, critic=False, reward=True, teacher=False):
    return [(g.name, g.size, g.resources.cpus, g.resources.gpus)
            for g in plan_layout(config(**(values or {})), needs_reference=reference, needs_critic=critic,
                                 has_reward=reward, needs_teacher=teacher).groups]


def test_each_role_gets_its_own_group_and_python_rewards_go_to_rollout_worker_0():
    assert layout({"policy_actors": 2, "policy_gpus": 1, "rollout_workers": 3, "rollout_cpus": 0.5}, critic=True) == [
        ("policy", 2, 1.0, 1.0), ("reference", 1, 1.0, 0.0), ("critic", 1, 1.0, 0.0), ("rollout+reward", 3, 0.5, 0.0)]
    groups = plan_layout(config(rollout_workers=2), needs_reference=False, needs_critic=False, has_reward=True).groups
    assert [g.roles_of(0) for g in groups] == [("policy",), ("rollout", "reward")]
    assert groups[1].roles_of(1) == ("rollout",)  # the reward sources live on rank 0 only


def test_colocation_puts_roles_into_one_process_per_rank():
    assert layout({"colocate": "policy_ref", "policy_actors": 2, "policy_cpus": 0.5}) == [
        ("policy+reference", 2, 0.5, 0.0), ("rollout+reward", 1, 1.0, 0.0)]
    assert layout({"colocate": "critic_reward", "critic_actors": 2, "critic_gpus": 0.5}, critic=True) == [
        ("policy", 1, 1.0, 0.0), ("reference", 1, 1.0, 0.0), ("critic+reward", 2, 1.0, 0.5), ("rollout", 1, 1.0, 0.0)]
    assert layout({"colocate": "all", "policy_actors": 2, "policy_gpus": 1}, critic=True) == [
        ("policy+reference+critic+rollout+reward", 2, 1.0, 1.0)]
    assert layout({"colocate": "all"}, reference=False, reward=False) == [("policy+rollout", 1, 1.0, 0.0)]


def test_both_pairs_colocate_together_as_openrlhfs_eight_gpu_layout():
    """--colocate policy_ref --colocate critic_reward: policy+reference and critic+reward host groups."""
    both = [("policy+reference", 4, 1.0, 1.0), ("critic+reward", 2, 1.0, 1.0), ("rollout", 2, 1.0, 1.0)]
    gpus = {"policy_actors": 4, "policy_gpus": 1, "critic_actors": 2, "critic_gpus": 1, "rollout_workers": 2,
            "rollout_gpus": 1}
    for colocate in (["policy_ref", "critic_reward"], ["critic_reward", "policy_ref"], "policy_ref,critic_reward",
                     ["policy_ref", "critic_reward", "policy_ref"]):
        assert layout({"colocate": colocate, **gpus}, critic=True) == both
    groups = plan_layout(config(colocate=["policy_ref", "critic_reward"], critic_actors=2), needs_reference=True,
                         needs_critic=True, has_reward=True).groups
    assert [(g.roles_of(0), g.roles_of(1)) for g in groups[:2]] == [
        (("policy", "reference"), ("policy", "reference")), (("critic", "reward"), ("critic",))]
    # Without a critic (GRPO), critic_reward still gives the rewards an actor of their own, as alone.
    assert layout({"colocate": ["policy_ref", "critic_reward"]}) == [
        ("policy+reference", 1, 1.0, 0.0), ("rollout", 1, 1.0, 0.0), ("reward", 1, 1.0, 0.0)]


def test_a_teacher_lives_where_the_reference_would():
    """--teacher (on-policy distillation): with the reference, or alone in the reference's place and
    with its flags; colocated with the policy under policy_ref and all."""
    assert layout({"ref_actors": 2, "ref_gpus": 0.5}, teacher=True) == [
        ("policy", 1, 1.0, 0.0), ("reference+teacher", 2, 1.0, 0.5), ("rollout+reward", 1, 1.0, 0.0)]
    assert layout({"ref_cpus": 0.25}, reference=False, teacher=True, reward=False) == [
        ("policy", 1, 1.0, 0.0), ("teacher", 1, 0.25, 0.0), ("rollout", 1, 1.0, 0.0)]
    assert layout({"colocate": "policy_ref", "policy_actors": 2}, reference=False, teacher=True) == [
        ("policy+teacher", 2, 1.0, 0.0), ("rollout+reward", 1, 1.0, 0.0)]
    assert layout({"colocate": "all"}, teacher=True, reward=False) == [("policy+reference+teacher+rollout", 1, 1.0, 0.0)]
    groups = plan_layout(config(ref_actors=2), needs_reference=False, needs_critic=False, has_reward=False,
                         needs_teacher=True).groups
    assert groups[1].roles_of(1) == ("teacher",) and groups[1].needs_process_group  # data-parallel like the reference


@pytest.mark.parametrize("colocate, expected", [
    ([], ()), ("none", ()), (["none"], ()), (["none", "none"], ()), ("all", ("all",)),
    (["policy_ref"], ("policy_ref",)),
    (["critic_reward", "policy_ref"], ("policy_ref", "critic_reward")), ("Policy-Ref", ("policy_ref",)),
])
def test_colocation_reads_one_value_several_or_a_config_files_string(colocate, expected):
    from rlhf.runtime.config.train_config import colocation

    assert colocation(colocate) == expected


@pytest.mark.parametrize("colocate, message", [
    (["all", "policy_ref"], r"--colocate all already puts every role in the policy actors, so it cannot be combined "
                            r"with policy_ref: give it alone"),
    (["critic_reward", "none"], r"--colocate none colocates nothing, so it cannot be combined with critic_reward"),
    (["policy_ref", "reward_critic"], r"--colocate 'reward_critic' is not one of none, policy_ref, critic_reward, all"),
])
def test_none_or_all_with_other_values_is_one_usage_error(colocate, message):
    with pytest.raises(ConfigError, match=message):
        config(colocate=colocate).derived()
    with pytest.raises(ConfigError, match=message):
        layout({"colocate": colocate})


def test_colocate_is_repeatable_on_the_command_line_and_refuses_bad_combinations(plugins, monkeypatch, tmp_path):
    import rlhf.runtime.ray as ray_runtime
    from rlhf.runtime.config.train_config import colocation
    from tests.helpers import run_cli

    seen = []
    monkeypatch.setattr(ray_runtime, "train", lambda config, plugins: seen.append(config) or tmp_path)
    data, reward = _task_files(tmp_path)
    base = ["train", "--model", "m", "--data", data, "--reward", reward, "--runtime", "ray"]
    both = ["--colocate", "policy_ref", "--colocate", "critic_reward"]
    for extra, expected in ((both, ("policy_ref", "critic_reward")), (["--colocate", "all"], ("all",)), ([], ())):
        result = run_cli(plugins, base + extra)
        assert result.exit_code == 0, result.output
        assert colocation(seen[-1].colocate) == expected
    (tmp_path / "run.yaml").write_text("colocate: critic_reward\n")
    assert run_cli(plugins, base + ["--config", str(tmp_path / "run.yaml")]).exit_code == 0
    assert seen[-1].colocate == ["critic_reward"]
    (tmp_path / "both.yaml").write_text("colocate: [policy_ref, critic_reward]\n")
    assert run_cli(plugins, base + ["--config", str(tmp_path / "both.yaml")]).exit_code == 0
    assert seen[-1].colocate == ["policy_ref", "critic_reward"]
    typo = run_cli(plugins, base + ["--colocate", "policy_reff"])
    assert typo.exit_code == 2 and "'policy_reff' is not one of" in typo.output
    # A combination with all or none stops the run before anything starts (exit 2, no traceback).
    monkeypatch.setattr(ray_runtime, "train", lambda config, plugins: config.derived())
    bad = run_cli(plugins, base + ["--colocate", "all", "--colocate", "critic_reward"])
    assert bad.exit_code == 2 and "--colocate all already puts every role in the policy actors" in bad.output
    assert "Traceback" not in bad.output


def test_reward_models_and_reward_gpus_get_a_reward_actor(tmp_path):
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text("{}")
    expected = [("policy", 1, 1.0, 0.0), ("rollout", 1, 1.0, 0.0), ("reward", 1, 1.0, 0.0)]
    assert layout({"reward": [f"{tmp_path / 'rm'}@0.5"]}, reference=False) == expected
    assert layout({"reward_gpus": 1}, reference=False)[-1] == ("reward", 1, 1.0, 1.0)
    assert layout({"colocate": "critic_reward"}, reference=False)[-1] == ("reward", 1, 1.0, 0.0)  # no critic to share


@pytest.mark.parametrize("values, message", [
    ({"colocate": "policy_ref", "policy_actors": 2, "ref_actors": 1}, "--ref-actors must equal --policy-actors"),
    ({"colocate": "all", "rollout_workers": 3}, "--rollout-workers must equal --policy-actors"),
    ({"policy_actors": 0}, "--policy-actors must be a whole number of at least 1"),
    ({"rollout_cpus": 0}, "request no resources"),
])
def test_contradictory_placement_flags_are_config_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        layout(values)


def test_the_working_directory_is_shipped_only_when_joining_a_cluster(tmp_path):
    assert job_runtime_env(config(), tmp_path, tmp_path / "runs" / "x") == {}
    env = job_runtime_env(config(ray_address="10.0.0.1:6379"), tmp_path, tmp_path / "out" / "run1")
    assert env["working_dir"] == str(tmp_path)
    assert {".git", ".venv", "runs", str(Path("out") / "run1")} <= set(env["excludes"])
    outside = job_runtime_env(config(ray_address="auto"), tmp_path / "code", tmp_path / "elsewhere")
    assert str(Path("..") / "elsewhere") not in outside["excludes"] and outside["working_dir"] == str(tmp_path / "code")


def test_worker_environment_passes_plugin_selection_on(monkeypatch):
    monkeypatch.setenv("RLHF_DISABLE_PLUGINS", "rlhf.plugins.loggers.plugin")
    env = worker_env(config(ray_env=["HF_HOME=/data/hf", "EMPTY="]))
    assert env == {"TOKENIZERS_PARALLELISM": "false", "RLHF_DISABLE_PLUGINS": "rlhf.plugins.loggers.plugin",
                   "HF_HOME": "/data/hf", "EMPTY": ""}
    with pytest.raises(ConfigError, match="--ray-env expects KEY=VALUE, got 'HF_HOME'"):
        worker_env(config(ray_env=["HF_HOME"]))


HOST = Host(handle=None, group="rollout+reward", roles=("rollout", "reward"), rank=0,
            info={"pid": 4242, "ip": "10.0.0.7", "hostname": "gpu-3"})


def test_worker_errors_name_the_role_rank_process_and_node():
    from ray.exceptions import ActorDiedError, RayTaskError

    died = failure(ActorDiedError(), HOST, "rollout.generate")
    assert isinstance(died, WorkerDiedError)
    assert str(died) == ("rollout+reward rank 0 [pid 4242 on node 10.0.0.7 (gpu-3)] died during rollout.generate: "
                         "its process is gone")
    raised = failure(RayTaskError("score", "Traceback ...", ConfigError("reward file missing")), HOST, "reward.score")
    assert type(raised) is ConfigError  # still a usage error on the command line
    assert str(raised) == "rollout+reward rank 0 [pid 4242 on node 10.0.0.7 (gpu-3)] failed during reward.score: " \
                          "reward file missing"
    bug = failure(RayTaskError("fit", "Traceback ...", KeyError("loss")), HOST, "policy.fit")
    assert isinstance(bug, WorkerFailedError) and str(bug).endswith("failed during policy.fit: KeyError: 'loss'")


def test_death_cause_keeps_rays_explanation_without_the_id_lines():
    class Died(Exception):
        BASE_ERROR_MSG = "The actor died unexpectedly before finishing this task."

    message = ("The actor died unexpectedly before finishing this task.\n\tclass_name: WorkerHost\n\tpid: 12\n"
               "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR")
    assert death_cause(Died(message)) == ("The actor is dead because its worker process has died. "
                                          "Worker exit type: SYSTEM_ERROR")


@pytest.mark.ray
def test_a_call_past_its_deadline_stops_with_a_timeout_error(ray_cluster):
    import time

    import ray

    slow = ray.remote(num_cpus=0.1)(lambda: time.sleep(30))
    with pytest.raises(WorkerTimeoutError, match=r"policy\.fit: no answer within 0\.2 s \(--ray-timeout-s\) from "
                                                 r"rollout\+reward rank 0 \[pid 4242"):
        wait([(HOST, slow.remote())], "policy.fit", 0.2)


def test_rlhf_train_shows_the_ray_flags_and_an_address_selects_the_ray_runtime(plugins, monkeypatch, tmp_path):
    import rlhf.runtime.ray as ray_runtime
    from tests.helpers import run_cli

    help_text = run_cli(plugins, ["train", "--help"]).output
    assert "[Ray] Data-parallel policy actors" in help_text and "--colocate [none|policy_ref|critic_reward|all]" \
        in help_text
    seen = []
    monkeypatch.setattr(ray_runtime, "train", lambda config, plugins: seen.append(config) or tmp_path)
    data, reward = _task_files(tmp_path)
    result = run_cli(plugins, ["train", "--model", "m", "--data", data, "--reward", reward, "--ray-address",
                               "10.0.0.1:6379", "--policy-actors", "2", "--rollout-cpus", "0.5"])
    assert result.exit_code == 0, result.output
    assert [(c.runtime, c.ray_address, c.policy_actors, c.rollout_cpus) for c in seen] == [
        ("ray", "10.0.0.1:6379", 2, 0.5)]


def test_a_local_cluster_is_not_started_for_more_gpus_than_the_machine_has(monkeypatch, tmp_path):
    import ray

    from rlhf.runtime.ray.cluster import Cluster

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `rlhf train` process
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("ray.init must not be called"))
    with pytest.raises(ConfigError, match=r"the run's actors need 1000 GPUs but this machine has \d+: lower "
                                          r"--\*-gpus, or join a cluster with --ray-address"):
        Cluster.open(config(policy_gpus=1000), cpus_needed=1, gpus_needed=1000, out_dir=tmp_path)


def test_ray_address_in_the_environment_joins_that_cluster_like_the_flag(monkeypatch, tmp_path):
    """`ray start` tells users to set RAY_ADDRESS; Ray's init would then refuse the local cluster's CPU count."""
    import ray

    from rlhf.runtime.ray.cluster import Cluster

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cluster = Cluster.open(config(), cpus_needed=1, gpus_needed=0, out_dir=tmp_path / "runs" / "x")
    assert (cluster.started, cluster.connected, cluster.ships_working_dir) == (False, True, True)
    assert [(c["address"], c["runtime_env"]["working_dir"]) for c in calls] == [("10.0.0.1:6379", str(tmp_path))]
    Cluster.open(config(ray_address="10.0.0.2:6379"), cpus_needed=1, gpus_needed=0, out_dir=tmp_path / "runs" / "x")
    assert calls[-1]["address"] == "10.0.0.2:6379"  # the flag wins
