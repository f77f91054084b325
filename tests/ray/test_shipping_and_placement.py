"""--ray-address packaging and placement (issue 19): the shipped folder honours .gitignore,
.rayignore and --ray-exclude, skips Ray temp dirs and is sized before zipping; a placement the
cluster can never hold fails at once, naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf.core.errors import ConfigError
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.ray.cluster import job_runtime_env
from rlhf.runtime.ray.placement import Layout, never_fits, plan_layout
from rlhf.runtime.ray.shipping import check_size, runtime_excludes, shipped_files

pytestmark = pytest.mark.cluster

MiB = 1024 * 1024


def config(**values):
    return TrainConfig.from_dict({"model": "m", "data": ["d.jsonl"], "reward": ["r.py"], **values})


def sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)  # no disk used: only the apparent size counts


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "rewards.py").write_text("def f(c): return [0.0]\n")
    sparse(tmp_path / "models" / "big" / "model.safetensors", 600 * MiB)
    sparse(tmp_path / "data" / "prompts.jsonl", 40 * MiB)
    return tmp_path


def test_a_big_folder_fails_before_zipping_and_names_what_is_big(project):
    with pytest.raises(ConfigError) as error:
        job_runtime_env(config(ray_address="10.0.0.1:6379"), project, project / "runs" / "x")
    message = str(error.value)
    assert "models/ 600.0 MiB" in message and "--ray-exclude" in message and ".rayignore" in message
    assert "\n" not in message


@pytest.mark.parametrize("how", ["rayignore", "gitignore", "flag"])
def test_ignore_files_and_the_flag_leave_folders_out(project, how):
    values = {"ray_address": "auto"}
    if how == "flag":
        values["ray_exclude"] = ["models/"]
    else:
        (project / f".{how}").write_text("# big things\nmodels/\n")
    env = job_runtime_env(config(**values), project, project / "runs" / "x")
    assert env["working_dir"] == str(project)
    shipped = dict(shipped_files(project, env["excludes"]))
    assert "train.py" in shipped and "data/prompts.jsonl" in shipped
    assert not any(p.startswith("models/") for p in shipped)


def test_nested_ignore_files_apply_below_their_folder(project):
    (project / "data" / ".gitignore").write_text("*.jsonl\n")
    (project / ".rayignore").write_text("models/\n")
    shipped = dict(shipped_files(project, runtime_excludes(config(), project, project / "runs")))
    assert "data/prompts.jsonl" not in shipped and "train.py" in shipped


def test_a_ray_temp_dir_inside_the_folder_is_never_shipped(project, monkeypatch):
    (project / ".rayignore").write_text("models/\n")
    temp = project / "raytmp"
    sparse(temp / "session_2026" / "logs" / "huge.log", 900 * MiB)
    (temp / "session_latest").symlink_to(temp / "session_2026")
    monkeypatch.setenv("RAY_TMPDIR", str(temp))
    assert "raytmp" in runtime_excludes(config(), project, project / "runs")
    other = project / "elsewhere-ray"  # found by its session_latest link even when not RAY_TMPDIR
    sparse(other / "session_1" / "big.bin", 900 * MiB)
    (other / "session_latest").symlink_to(other / "session_1")
    assert check_size(project, runtime_excludes(config(), project, project / "runs")) < 100 * MiB


def test_the_limit_follows_rays_setting(project):
    (project / ".rayignore").write_text("models/\n")
    with pytest.raises(ConfigError, match="over Ray's 10.0 MiB limit; biggest: data/ 40.0 MiB"):
        check_size(project, runtime_excludes(config(), project, project / "runs"), limit=10 * MiB)


def test_ray_exclude_is_a_documented_flag(plugins):
    from tests.helpers import run_cli

    result = run_cli(plugins, ["train", "--help"])
    assert "--ray-exclude" in result.output


def layout(**values):
    return plan_layout(config(**values), needs_reference=False, needs_critic=False, has_reward=True)


def test_a_layout_larger_than_the_cluster_never_fits():
    reason = never_fits(layout(policy_cpus=2, rollout_cpus=1), {"CPU": 2.0}, [{"CPU": 2.0}])
    assert reason is not None and "3 CPUs (the cluster has 2)" in reason


def test_a_bundle_larger_than_any_node_never_fits():
    reason = never_fits(layout(policy_cpus=3, rollout_cpus=1), {"CPU": 8.0}, [{"CPU": 2.0}] * 4)
    assert reason is not None and "largest node has 2 CPUs" in reason


def test_a_layout_that_fits_once_free_is_not_refused():
    assert never_fits(layout(policy_cpus=1, rollout_cpus=1), {"CPU": 2.0}, [{"CPU": 2.0}]) is None
    assert never_fits(layout(policy_gpus=1, policy_cpus=0.5), {"CPU": 4.0, "GPU": 2.0},
                      [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]) is None


@pytest.mark.timeout(120)
def test_placement_that_can_never_fit_fails_at_once(ray_cluster):
    import time

    from rlhf.runtime.ray.placement import create_placement_groups

    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"can never place this run: the run's actors need 3 CPUs \(the cluster "
                                          r"has 2\)"):
        create_placement_groups(layout(policy_cpus=2, rollout_cpus=1), timeout_s=1800)
    assert time.monotonic() - began < 60  # not the 30-minute timeout


def test_progress_is_logged_while_waiting(ray_cluster, caplog, monkeypatch):
    import ray

    from rlhf.runtime.ray import placement

    monkeypatch.setattr(placement, "PROGRESS_EVERY_S", 0.2)
    blocker = ray.util.placement_group([{"CPU": 2.0}])  # every CPU taken: ours must wait
    ray.get(blocker.ready(), timeout=60)
    try:
        with caplog.at_level("WARNING"), pytest.raises(ConfigError, match="could not place the run's actors within"):
            placement.create_placement_groups(layout(policy_cpus=1, rollout_cpus=1), timeout_s=1.0)
    finally:
        ray.util.remove_placement_group(blocker)
    assert any("Waiting for the Ray cluster to place" in r.getMessage() for r in caplog.records)


def test_ray_place_pins_a_host_group_to_the_nodes_with_a_resource():
    groups = layout(ray_place=["policy=trainer", "rollout = node:10.0.0.2"], rollout_workers=2, rollout_cpus=0.5).groups
    assert [(g.name, g.resources.bundle()) for g in groups] == [
        ("policy", {"CPU": 1.0, "trainer": 0.001}), ("rollout+reward", {"CPU": 0.5, "node:10.0.0.2": 0.001})]
    assert "rollout+reward ×2 (0.5 CPU, 0 GPU each, on node:10.0.0.2)" in Layout(groups).describe()
    colocated = plan_layout(config(colocate="policy_ref", ray_place=["reference=trainer"]), needs_reference=True,
                            needs_critic=False, has_reward=True).groups
    assert [g.resources.place for g in colocated] == ["trainer", None]  # a colocated role takes its host group along
    assert layout(ray_place=["critic=gpu-box"]).groups == layout().groups  # no critic in this run: nothing to place


@pytest.mark.parametrize("values, message", [
    ({"ray_place": ["policy"]}, "--ray-place expects ROLE=RESOURCE with ROLE one of policy, reference, teacher, critic, "
                                "rollout, reward, got 'policy'"),
    ({"ray_place": ["actor=trainer"]}, "got 'actor=trainer'"),
    ({"ray_place": ["policy="]}, "got 'policy='"),
    ({"ray_place": ["policy=a", "policy=b"]}, "--ray-place names two places for policy: a and b"),
    ({"ray_place": ["rollout=a", "reward=b"]}, r"the rollout\+reward actors on different resources \(a, b\)"),
])
def test_contradictory_places_are_config_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        layout(**values)


def test_a_place_no_node_has_or_too_small_a_placed_node_never_fits():
    nodes = [{"CPU": 4.0, "node_a": 1.0}, {"CPU": 1.0, "node_b": 1.0}]
    total = {"CPU": 5.0, "node_a": 1.0, "node_b": 1.0}
    assert never_fits(layout(ray_place=["policy=node_a", "rollout=node_b"]), total, nodes) is None
    reason = never_fits(layout(ray_place=["rollout=node_c"]), total, nodes)
    assert reason == ("no node has the Ray resource 'node_c' that --ray-place gives the rollout+reward actors (start "
                      "one with ray start --resources '{\"node_c\": 1}', or name a node:IP resource)")
    reason = never_fits(layout(ray_place=["policy=node_b"], policy_cpus=2), total, nodes)
    assert reason == ("one policy actor needs 2 CPUs and 0 GPUs on one node, but the largest node with node_b has "
                      "1 CPUs and 0 GPUs")  # the 4-CPU node lacks node_b
