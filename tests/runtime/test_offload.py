"""--offload-train-state and --offload-ref-reward: the training state (optimizer state, gradients)
and the frozen models leave their storage and come back bit for bit; a run with both options
gives exactly the run without them; the options are refused where they cannot work."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.core.errors import ConfigError
from rlhf.core.offload import ModuleOffload, TrainStateOffload, shares_parameters
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.config.train_plan import RunPlan
from tests.helpers import final_weights, read_jsonl, run_cli, small_config
from tests.models.checkpoints import save_classifier, tokenizer


def torch_backend(model, lr=1e-2):
    from rlhf.plugins.backends.torch_backend import BackendConfig, TorchBackend

    return TorchBackend(model, BackendConfig(lr=lr))


def train_step(model, backend, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=generator)  # (B, in)
    backend.backward(model(x).square().mean())
    return backend.step()


def snapshot(backend):
    return {"state": copy.deepcopy(backend.optimizer.state_dict()["state"]),
            "grads": [None if p.grad is None else p.grad.clone() for p in backend.params],
            "params": [p.detach().clone() for p in backend.params]}


def assert_equal_snapshots(a, b):
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        for name, value in a["state"][key].items():
            assert torch.equal(value, b["state"][key][name]), (key, name)
    for x, y in zip(a["grads"] + a["params"], b["grads"] + b["params"], strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.unit
def test_the_torch_backends_training_state_leaves_and_comes_back_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    backend = torch_backend(model)
    train_step(model, backend, 1)
    backend.backward(model(torch.ones(2, 6)).sum())  # gradients pending, as between micro-batches
    before = snapshot(backend)
    originals = [t for state in backend.optimizer.state.values() for t in state.values()]  # held: no address reuse
    storages = [t.data_ptr() for t in originals]

    moved = backend.offload_state()
    away = [t.data_ptr() for state in backend.optimizer.state.values() for t in state.values()]
    assert len(away) == len(storages) == 3 * 4  # exp_avg, exp_avg_sq, step for 4 tensors
    assert not set(away) & set(storages), "the optimizer state did not move"
    assert all(p.grad is None for p in backend.params)
    param_bytes = sum(p.numel() * 4 for p in backend.params)
    assert moved == 2 * param_bytes + 4 * 4 + param_bytes  # two moments, four step counts, the gradients

    backend.reload_state()
    assert_equal_snapshots(snapshot(backend), before)
    assert backend.offload_state() > 0 and backend.offload_state() == 0  # offloading twice moves nothing more
    backend.reload_state()
    backend.reload_state()  # reloading twice: nothing more either
    assert_equal_snapshots(snapshot(backend), before)


@pytest.mark.unit
def test_training_with_the_state_set_aside_between_steps_is_training_without():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    backends = [torch_backend(m) for m in models]
    for seed in range(4):
        for index, (model, backend) in enumerate(zip(models, backends)):
            train_step(model, backend, seed)
            if index == 1:
                backend.offload_state()
                backend.reload_state()
    assert_equal_snapshots(snapshot(backends[1]), snapshot(backends[0]))


@pytest.mark.unit
def test_a_frozen_model_leaves_and_comes_back_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 4))  # running statistics: buffers that must travel too
    before = {name: t.clone() for name, t in model.state_dict().items()}
    params = list(model.parameters())
    originals = [t.data for t in model.state_dict().values()]  # held: no address reuse
    storages = [t.data_ptr() for t in originals]
    away = ModuleOffload(model)
    moved = away.offload()
    assert moved == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert not {t.data_ptr() for t in model.state_dict().values()} & set(storages)
    with away.in_use():
        assert list(model.parameters()) == params  # the same Parameter objects, new storage
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, before[name]), name
    assert away.offloaded
    away.reload()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.unit
def test_shares_parameters_tells_a_view_from_a_copy():
    model = torch.nn.Linear(2, 2)
    view = torch.nn.Sequential(model)
    assert shares_parameters(view, model) and not shares_parameters(copy.deepcopy(model), model)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return save_classifier(tmp_path_factory.mktemp("rm"), tokenizer())


@pytest.mark.run
def test_a_run_with_both_offloads_is_the_run_without(tiny_model_dir, task, reward_model_dir, tmp_path, plugins,
                                                     monkeypatch):
    """Through the CLI: GRPO with a reference and a reward model beside a reward function. The state
    leaves at every generation, the reference and reward model between uses; metrics and final weights
    are the plain run's to the bit."""
    args = ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(task / "rewards.py"), "--reward", str(reward_model_dir), "--prompts-per-step", "2",
            "--n-samples", "2", "--max-new-tokens", "4", "--micro-batch-size", "2", "--steps", "3", "--lr", "1e-2",
            "--kl-coef", "0.1", "--seed", "7", "--no-progress"]
    plain = run_cli(plugins, args + ["--out", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output

    calls = []
    for cls in (ModuleOffload, TrainStateOffload):
        original = cls.offload

        def spy(self, original=original, cls=cls):
            moved = original(self)
            calls.append((cls.__name__, moved))
            return moved

        monkeypatch.setattr(cls, "offload", spy)
    offloaded = run_cli(build_plugin_manager(), args + ["--out", str(tmp_path / "offloaded"), "--offload-train-state",
                                                        "--offload-ref-reward"])
    assert offloaded.exit_code == 0, offloaded.output

    train_state = [moved for name, moved in calls if name == "TrainStateOffload"]
    assert len(train_state) == 3 and train_state[0] == 0 and train_state[1] > 0  # no state before the first step
    frozen = [moved for name, moved in calls if name == "ModuleOffload"]
    assert len(frozen) == 1 + 3 + 3 and all(frozen)  # the reference at build and after each use, the reward model
    timings = ("time/", "perf/", "throughput/", "memory/")
    for a, b in zip(read_jsonl(tmp_path / "plain" / "metrics.jsonl"), read_jsonl(tmp_path / "offloaded" /
                                                                                  "metrics.jsonl"), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(timings)} == \
            {k: v for k, v in b.items() if not k.startswith(timings)}
    for (name, a), b in zip(final_weights(tmp_path / "plain").items(), final_weights(tmp_path / "offloaded").values()):
        assert torch.equal(a, b), name


@pytest.mark.unit
@pytest.mark.parametrize("overrides, message", [
    (dict(runtime="ray"), "--offload-train-state .* needs --colocate all"),
    (dict(async_rollout=True), "--async generates while training"),
])
def test_offloading_the_train_state_is_refused_where_it_cannot_work(tiny_model_dir, task, tmp_path, overrides, message):
    config = small_config(tiny_model_dir, task, tmp_path / "run", offload_train_state=True, **overrides)
    with pytest.raises(ConfigError, match=message):
        RunPlan.make(config, build_plugin_manager()).check(world_size=1)
