"""One test per hook spec (the meta-tests at the bottom keep it so), plus docs coverage."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import click
import pytest

from rlhf.core.plugin_host import hookspecs
from rlhf.core.errors import PluginError
from rlhf.core.plugin_host.kinds import KIND_BY_HOOK
from rlhf.core.types import AlgorithmPreset, RunInfo
from tests.helpers import run_cli

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(name for name, obj in vars(hookspecs).items() if hasattr(obj, "rlhf_spec"))


def _register_one(bare_plugins, make_plugin, hook, obj, **flags):
    """Register ``obj`` through ``hook`` from a test plugin; return its component."""
    kind = KIND_BY_HOOK[hook]
    record = bare_plugins.register(make_plugin(f"plugin_for_{hook}", **{hook: lambda register: register("thing", obj, **flags)}))
    component = bare_plugins.registry(kind.name).component("thing")
    assert record.status == "ok" and component.provider is record
    assert record.provides == {kind.name: ["thing"]}
    return component


def test_hook_register_advantage_estimators(bare_plugins, make_plugin):
    def estimator(inputs, config):
        return inputs.rewards, inputs.rewards

    component = _register_one(bare_plugins, make_plugin, "register_advantage_estimators", estimator, needs_groups=True)
    assert component.load() is estimator
    assert component.capabilities == {"needs_critic": False, "needs_groups": True, "supports_masking": False,
                                      "implements": None}


def test_hook_register_policy_losses(bare_plugins, make_plugin):
    def loss(inputs, config):
        return inputs.logprobs, {}

    assert _register_one(bare_plugins, make_plugin, "register_policy_losses", loss).load() is loss


def test_hook_register_kl_estimators(bare_plugins, make_plugin):
    def kl(logprobs, ref_logprobs):
        return logprobs - ref_logprobs

    assert _register_one(bare_plugins, make_plugin, "register_kl_estimators", kl).load()(3.0, 1.0) == 2.0


def test_hook_register_loss_aggregations(bare_plugins, make_plugin):
    def total(loss, action_mask, norm):
        return loss

    assert _register_one(bare_plugins, make_plugin, "register_loss_aggregations", total).load() is total


def test_hook_register_algorithms(bare_plugins, make_plugin):
    preset = AlgorithmPreset(advantage="grpo", kl_in="loss", kl_estimator="k3", kl_coef=0.001)
    component = _register_one(bare_plugins, make_plugin, "register_algorithms", preset)
    assert component.load().kl_in == "loss"


def test_hook_register_algorithms_rejects_a_plain_dict(bare_plugins, make_plugin):
    record = bare_plugins.register(make_plugin(register_algorithms=lambda register: register("bad", {"advantage": "x"})))
    bare_plugins.registries()
    assert record.status == "error" and "should be an rlhf.core.types.AlgorithmPreset" in record.error


def test_hook_register_rewards(bare_plugins, make_plugin):
    async def judge(completions):
        return [1.0] * len(completions)

    component = _register_one(bare_plugins, make_plugin, "register_rewards", judge, batched=True)
    assert component.capabilities == {"batched": True, "is_async": None}


def test_hook_register_envs(bare_plugins, make_plugin):
    class Echo:
        def reset(self, prompt, label):
            return None

    assert _register_one(bare_plugins, make_plugin, "register_envs", Echo).load() is Echo


def test_hook_register_models(bare_plugins, make_plugin):
    from rlhf.core.protocols.adapter import ModelAdapterBase

    class Frozen(ModelAdapterBase):
        def __init__(self, config):
            self.config = config

        def load_tokenizer(self, ref):
            return None

        def load(self, ref, *, role):
            return None

    component = _register_one(bare_plugins, make_plugin, "register_models", Frozen, roles=("policy",))
    assert component.capabilities["roles"] == ("policy",)


def test_hook_register_rollout_engines(bare_plugins, make_plugin):
    class Engine:
        shares_weights = True

        def generate(self, prompts, *, n, params):
            return []

        def load_weights(self, state=None):
            pass

    component = _register_one(bare_plugins, make_plugin, "register_rollout_engines", Engine, needs_gpu=True)
    assert component.capabilities == {"needs_gpu": True, "continuous_batching": False}


def test_hook_register_train_backends(bare_plugins, make_plugin):
    from rlhf.core.protocols.backend import TrainBackendBase

    class Backend(TrainBackendBase):
        def backward(self, loss):
            loss.backward()

        def step(self):
            return {"grad_norm": 0.0, "lr": 0.0, "skipped": 0.0}

        def zero_grad(self):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    assert _register_one(bare_plugins, make_plugin, "register_train_backends", Backend).capabilities == {
        "needs_gpu": False, "offloads_state": False, "sharding_setting": None, "shards_weights": False}


def test_hook_register_objectives(bare_plugins, make_plugin):
    from rlhf.core.protocols.objective import ObjectiveBase

    class Constant(ObjectiveBase):
        def columns(self):
            return ["text"]

        def encode(self, row, text):
            return text.ids(row["text"])

        def collate(self, examples, pad_token_id):
            return {"input_ids": examples}

        def loss(self, models, batch, stats):
            return 0.0, {}

    component = _register_one(bare_plugins, make_plugin, "register_objectives", Constant, needs_reference=True)
    assert component.load() is Constant
    assert component.capabilities == {"needs_reference": True, "needs_teacher": False, "head": "lm",
                                      "default_lr": 1e-5, "command": False, "example": None,
                                      "preference_strength": None}


@pytest.mark.parametrize("hook, missing", [
    ("register_models", "load, load_tokenizer, save, save_critic"),
    ("register_objectives", "collate, columns, encode, final_statistics, loss, output_config, step_examples, "
                            "step_statistics, units"),
    ("register_rollout_engines", "generate, load_weights, shares_weights"),
    ("register_train_backends", "backward, full_weights, load_checkpoint, load_state_dict, save_checkpoint, "
                                "shards_state, shards_weights, state_dict, step, train_module, zero_grad"),
])
def test_classes_that_break_their_protocol_are_refused_at_registration(bare_plugins, make_plugin, hook, missing):
    class Nothing:
        pass

    record = bare_plugins.register(make_plugin(**{hook: lambda register: register("thing", Nothing)}))
    bare_plugins.registries()
    assert record.status == "error" and f"(missing: {missing})" in record.error, record.error


def test_a_backend_that_shards_its_state_must_write_its_own_checkpoints(bare_plugins, make_plugin):
    from rlhf.core.protocols.backend import TrainBackendBase

    class Sharded(TrainBackendBase):
        shards_state = True
        backward = step = zero_grad = state_dict = load_state_dict = None

    record = bare_plugins.register(make_plugin(register_train_backends=lambda register: register("s", Sharded)))
    bare_plugins.registries()
    assert record.status == "error" and "overrides save_checkpoint and load_checkpoint" in record.error


def test_hook_register_commands(bare_plugins, make_plugin):
    @click.command("hello")
    @click.option("--name", default="world")
    def hello(name):
        """Say hello."""
        click.echo(f"hello {name}")

    @click.command("plugins")
    def impostor():
        click.echo("not the real one")

    def add(cli):
        cli.add_command(hello)
        cli.add_command(impostor)

    record = bare_plugins.register(make_plugin("greeter", register_commands=add))
    assert run_cli(bare_plugins, ["hello", "--name", "rl"]).output == "hello rl\n"
    assert "Inspect installed plugins" in run_cli(bare_plugins, ["plugins", "--help"]).output
    assert any("plugins already exist" in w for w in record.warnings)
    assert record.provides["command"] == ["hello"]


def test_hook_register_commands_failure_is_recorded(bare_plugins, make_plugin):
    def add(cli):
        raise RuntimeError("no config file")

    record = bare_plugins.register(make_plugin("broken_cmd", register_commands=add))
    assert run_cli(bare_plugins, ["--help"]).exit_code == 0
    assert record.status == "error" and "register_commands failed: RuntimeError: no config file" in record.error


# --- lifecycle hooks: the host passes each implementation only the arguments it declares ---

@pytest.fixture
def run_info(tmp_path):
    return RunInfo(config={"algo": "grpo"}, out_dir=tmp_path, total_steps=3)


def test_hook_on_run_start(bare_plugins, make_plugin, run_info):
    seen = []
    bare_plugins.register(make_plugin(on_run_start=lambda run: seen.append(run)))
    bare_plugins.emit("on_run_start", run=run_info)
    assert seen == [run_info]


def test_hook_on_rollout_end(bare_plugins, make_plugin, run_info):
    seen = []
    bare_plugins.register(make_plugin(on_rollout_end=lambda trajectories, step: seen.append((trajectories, step))))
    bare_plugins.emit("on_rollout_end", run=run_info, step=4, trajectories=["t0", "t1"])
    assert seen == [(["t0", "t1"], 4)]


def test_hook_register_sample_filters(bare_plugins, make_plugin):
    def keep_all(groups, config):
        return [True] * len(groups)

    assert _register_one(bare_plugins, make_plugin, "register_sample_filters", keep_all).load()([[], []], None) == \
        [True, True]


def test_hook_register_reward_shapings(bare_plugins, make_plugin):
    def halve(trajectories, rewards, config):
        return [r / 2 for r in rewards], {}

    assert _register_one(bare_plugins, make_plugin, "register_reward_shapings", halve).load()([], [2.0], None) == \
        ([1.0], {})


def test_hook_on_eval(bare_plugins, make_plugin, run_info):
    seen = []
    bare_plugins.register(make_plugin(on_eval=lambda step, metrics: seen.append((step, metrics))))
    bare_plugins.emit("on_eval", run=run_info, step=0, metrics={"eval/reward/mean": 0.25})
    assert seen == [(0, {"eval/reward/mean": 0.25})]


def test_hook_on_rewards(bare_plugins, make_plugin, run_info):
    def on_rewards(rewards):
        rewards[0] = -1.0  # edits in place are what the runtime sees

    bare_plugins.register(make_plugin(on_rewards=on_rewards))
    rewards = [1.0, 1.0]
    bare_plugins.emit("on_rewards", run=run_info, step=0, trajectories=[], rewards=rewards)
    assert rewards == [-1.0, 1.0]


def test_hook_on_step_end(bare_plugins, make_plugin, run_info):
    seen = []
    bare_plugins.register(make_plugin(on_step_end=lambda step, metrics: seen.append((step, metrics))))
    bare_plugins.emit("on_step_end", run=run_info, step=2, metrics={"reward/mean": 0.5})
    assert seen == [(2, {"reward/mean": 0.5})]


def test_hook_on_checkpoint(bare_plugins, make_plugin, run_info, tmp_path):
    seen = []
    bare_plugins.register(make_plugin(on_checkpoint=lambda path, step, run: seen.append((path, step, run))))
    bare_plugins.emit("on_checkpoint", run=run_info, step=10, path=tmp_path / "step_10")
    assert seen == [(tmp_path / "step_10", 10, run_info)]


def test_hook_on_run_end(bare_plugins, make_plugin, run_info):
    seen = []
    bare_plugins.register(make_plugin(on_run_end=lambda status: seen.append(status)))
    bare_plugins.emit("on_run_end", run=run_info, status="completed")
    assert seen == ["completed"]


def test_lifecycle_hooks_run_in_pluggy_order_and_errors_name_the_plugin(bare_plugins, make_plugin, run_info):
    calls = []
    bare_plugins.register(make_plugin("first_registered", on_step_end=lambda step: calls.append("first")))
    bare_plugins.register(make_plugin("second_registered", on_step_end=lambda step: calls.append("second")))
    bare_plugins.emit("on_step_end", run=run_info, step=0, metrics={})
    assert calls == ["second", "first"]  # pluggy calls the latest registration first

    def explode(step):
        raise KeyError("missing metric")

    bare_plugins.register(make_plugin("bad_logger", on_step_end=explode), distribution="rlhf-badlog", version="0.9")
    with pytest.raises(PluginError, match=r"plugin rlhf-badlog 0.9 \(bad_logger\) failed in on_step_end: KeyError"):
        bare_plugins.emit("on_step_end", run=run_info, step=1, metrics={})


# --- meta-tests -------------------------------------------------------------------------

def test_every_hook_spec_has_a_test():
    tested = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_hook_"):
                tested.add(node.name.removeprefix("test_hook_"))
    missing = [spec for spec in SPECS if not any(t == spec or t.startswith(spec + "_") for t in tested)]
    assert not missing, f"hook specs without a test_hook_<name> test: {missing}"


def test_hook_docs_are_generated_from_the_current_specs():
    import runpy

    render = runpy.run_path(str(ROOT / "docs" / "generate_hook_docs.py"))["render"]
    assert (ROOT / "docs" / "plugin-hooks.md").read_text() == render(), (
        "docs/plugin-hooks.md is stale: run `python docs/generate_hook_docs.py`"
    )


def test_every_hook_spec_is_documented_with_its_arguments():
    docs = (ROOT / "docs" / "plugin-hooks.md").read_text()
    for spec in SPECS:
        args = ", ".join(inspect.signature(getattr(hookspecs, spec)).parameters)
        assert f"{spec}({args})" in docs, f"docs/plugin-hooks.md does not document {spec}({args})"
    assert "docs/plugin-hooks.md" in (ROOT / "README.md").read_text()


def test_every_registration_hook_fills_a_kind():
    registration = [s for s in SPECS if s.startswith("register_") and s != "register_commands"]
    assert sorted(registration) == sorted(KIND_BY_HOOK)
    for spec in registration:
        assert re.search(r"register\(name, ", inspect.getdoc(getattr(hookspecs, spec))), spec
