"""What the host knows of a component comes from its registration, so a third-party component that
declares what a built-in declares gets the built-in's treatment: the example in ``rlhf NAME
--help`` (``example=``), the objective and strength ``rlhf iterate`` trains with
(``preference_strength=``), the adapter setting that merges on export (``merge_setting=``), the
backend setting advice names (``sharding_setting=``) and continuous batching
(``continuous_batching=``). Declarations are checked where they are made, and nothing is probed:
an engine with ``generate_one`` that does not declare continuous batching does not get it, and an
environment that answers every attribute through ``__getattr__`` is not taken to declare any."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlhf.core.errors import ConfigError, PluginError
from rlhf.core.plugin_host.kinds import get_kind
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.core.plugin_host.record import PluginRecord
from rlhf.core.plugin_host.registry import declared_registration, make_component
from rlhf.core.protocols.environment import EnvDeclarations
from rlhf.core.protocols.objective import ObjectiveBase
from rlhf.core.protocols.rollout import Generation, SamplingParams, batches_continuously
from rlhf.core.protocols.backend import TrainBackendBase
from rlhf.core.protocols.adapter import ModelAdapterBase
from tests.helpers import run_cli

pytestmark = pytest.mark.unit

HERE = "tests.core.test_declared"


# --- a third-party plugin declaring what the built-ins declare ------------------------------------


@dataclass(kw_only=True)
class PairsConfig:
    tau: float = field(default=1.0, metadata={"help": "How strongly the policy stays near its reference"})


class PairsObjective(ObjectiveBase):
    """A preference objective (never run here: these tests stop before any model)."""

    def columns(self):
        return ["prompt", "chosen", "rejected"]

    def encode(self, row, text):
        return row

    def collate(self, examples, pad_token_id):
        return {}

    def loss(self, models, batch, stats):
        return 0.0, {}


@dataclass(kw_only=True)
class MergeConfig:
    merge_adapter: bool = field(default=False, metadata={"help": "Also save the merged model to <final>/merged"})


class MergingAdapter(ModelAdapterBase):
    def __init__(self, config=None):
        self.config = config

    def load_tokenizer(self, ref):
        return None

    def load(self, ref, *, role):
        return None


@dataclass(kw_only=True)
class ShardConfig:
    shard_level: int = field(default=3, metadata={"help": "0: whole weights on every rank, 3: sharded"})


class ShardingBackend(TrainBackendBase):
    shards_weights = True

    def backward(self, loss):
        pass

    def step(self):
        return {"grad_norm": 0.0, "lr": 0.0, "skipped": 0.0}

    def zero_grad(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class TurnEngine:
    """An engine that generates turn by turn (`RolloutEngine` only)."""

    shares_weights = True

    def generate(self, prompts, *, n, params):
        return [Generation(token_ids=[1], finish_reason="stop") for _ in range(len(prompts) * n)]

    def load_weights(self, state=None):
        pass


class RequestEngine(TurnEngine):
    """Continuous batching too (`ContinuousEngine`), for prompts of any sampling but greedy."""

    async def generate_one(self, prompt_ids, params):
        return Generation(token_ids=[1], finish_reason="stop")

    def continuous_for(self, params):
        return params.temperature > 0


def register_objectives(register):
    register("my_pairs", f"{HERE}:PairsObjective", config_cls=f"{HERE}:PairsConfig", needs_reference=True,
             command=True, preference_strength="tau", example="rlhf my_pairs --model m --data pairs.jsonl --tau 2")


def register_models(register):
    register("merging", f"{HERE}:MergingAdapter", config_cls=f"{HERE}:MergeConfig", merge_setting="merge_adapter")
    register("plain", f"{HERE}:MergingAdapter", config_cls=f"{HERE}:MergeConfig")


def register_train_backends(register):
    register("my_sharded", f"{HERE}:ShardingBackend", config_cls=f"{HERE}:ShardConfig",
             short_flags=("shard_level",), sharding_setting="shard_level")
    register("my_sharded_long", f"{HERE}:ShardingBackend", config_cls=f"{HERE}:ShardConfig",
             sharding_setting="shard_level")


def register_rollout_engines(register):
    register("requests", f"{HERE}:RequestEngine", continuous_batching=True)
    register("undeclared", f"{HERE}:RequestEngine")


@pytest.fixture
def third_party(make_plugin):
    plugins = build_plugin_manager(load_entrypoints=False)
    record = plugins.register(make_plugin(
        "third_party", register_objectives=register_objectives, register_models=register_models,
        register_train_backends=register_train_backends, register_rollout_engines=register_rollout_engines))
    assert record.status == "ok", record.error
    return plugins


def _record() -> PluginRecord:
    return PluginRecord(name="inline", distribution=None, version=None, source="inline")


# --- example= ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, example", [
    ("my_pairs", "rlhf my_pairs --model m --data pairs.jsonl --tau 2"),
    ("dpo", "rlhf dpo --model runs/sft/final --data pairs.jsonl --beta 0.1 --out runs/dpo"),
])
def test_an_objectives_help_shows_the_example_it_registered(third_party, name, example):
    result = run_cli(third_party, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert example in " ".join(result.output.split())


def test_an_objective_without_an_example_gets_a_generic_one(make_plugin):
    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(make_plugin("bare", register_objectives=lambda register: register(
        "no_example", f"{HERE}:PairsObjective", command=True)))
    result = run_cli(plugins, ["no_example", "--help"])
    assert "rlhf no_example --model ... --data ... --out runs/no_example" in result.output


# --- preference_strength= and merge_setting=: rlhf iterate ------------------------------------------


def _iterate_round(plugins, tmp_path, monkeypatch, *, merged: bool = False, **options):
    """The config iterate's objective run gets (the run itself replaced by writing ``final/``), and the
    model the round hands on."""
    import rlhf.runtime.fit.local
    from rlhf.datagen import iterate
    from rlhf.datagen.config import IterateConfig

    seen = []

    def fake_fit(config, *, plugins):
        seen.append(config)
        (Path(config.out) / "final" / ("merged" if merged else "")).mkdir(parents=True)
        return Path(config.out)

    monkeypatch.setattr(rlhf.runtime.fit.local, "fit", fake_fit)
    config = IterateConfig(model="start", data=["d.jsonl"], reward=["r"], out=str(tmp_path), beta=0.5, **options)
    objective = iterate._objective(config, plugins)
    model = iterate._dpo(config, objective, "start", tmp_path / "pairs.jsonl", tmp_path / objective.name, plugins)
    return seen[0], model


def test_iterate_trains_with_a_third_party_objective_and_sets_the_strength_it_declared(third_party, tmp_path,
                                                                                     monkeypatch):
    config, model = _iterate_round(third_party, tmp_path, monkeypatch, objective="my_pairs")
    assert config.objective == "my_pairs" and config.components["objective"] == {"tau": 0.5}
    assert config.out == str(tmp_path / "my_pairs") and model == tmp_path / "my_pairs" / "final"


def test_iterate_gives_dpo_the_same_treatment(third_party, tmp_path, monkeypatch):
    config, _ = _iterate_round(third_party, tmp_path, monkeypatch)
    assert config.objective == "dpo" and config.components["objective"] == {"beta": 0.5}
    assert config.components["model_adapter"]["merge_lora"] is True  # the hf adapter's merge_setting


def test_iterate_refuses_an_objective_that_declares_no_preference_strength(third_party, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"the 'sft' objective does not declare that it learns from them .* "
                                          r"use --objective dpo or my_pairs"):
        _iterate_round(third_party, tmp_path, monkeypatch, objective="sft")


def test_iterate_asks_a_third_party_adapter_for_its_merged_model_by_the_setting_it_declared(third_party, tmp_path,
                                                                                          monkeypatch):
    config, model = _iterate_round(third_party, tmp_path, monkeypatch, merged=True, model_adapter="merging")
    assert config.components["model_adapter"] == {"merge_adapter": True}
    assert model == tmp_path / "dpo" / "final" / "merged"


def test_iterate_leaves_an_adapter_that_declares_no_merge_setting_alone(third_party, tmp_path, monkeypatch):
    config, model = _iterate_round(third_party, tmp_path, monkeypatch, merged=True, model_adapter="plain")
    assert config.components.get("model_adapter", {}) == {}
    assert model == tmp_path / "dpo" / "final"  # a merged/ folder it did not ask for is not the round's model


def test_a_user_choice_of_the_merge_setting_is_kept(third_party, tmp_path, monkeypatch):
    config, _ = _iterate_round(third_party, tmp_path, monkeypatch, model_adapter="merging",
                               components={"model_adapter": {"merge_adapter": False}})
    assert config.components["model_adapter"] == {"merge_adapter": False}


# --- sharding_setting=: the advice to keep weights whole -------------------------------------------


@pytest.mark.parametrize("backend, advice", [
    ("deepspeed", "lower --zero-stage (the 'deepspeed' backend's sharding setting) until it keeps whole weights"),
    ("my_sharded", "lower --shard-level (the 'my_sharded' backend's sharding setting) until it keeps whole weights"),
    ("my_sharded_long", "lower --backend.shard-level (the 'my_sharded_long' backend's sharding setting)"),
    ("torch", "use a backend that keeps whole weights on every rank (not 'torch')"),
])
def test_the_advice_to_keep_weights_whole_names_the_sharding_setting_the_backend_declared(third_party, backend,
                                                                                        advice):
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.config.train_plan import RunPlan

    plan = RunPlan.make(TrainConfig(model="m", data=["d"], backend=backend), third_party)
    assert plan.whole_weights_advice().startswith(advice)


# --- declarations are checked where they are made ---------------------------------------------------


@pytest.mark.parametrize("kind, obj, flags, match", [
    ("train_backend", ShardingBackend, {"config_cls": ShardConfig, "sharding_setting": "zero_stage"},
     r"sharding_setting='zero_stage' names no setting of ShardConfig"),
    ("train_backend", ShardingBackend, {"sharding_setting": "shard_level"},
     r"sharding_setting name settings of a config_cls; it has none"),
    ("model", MergingAdapter, {"config_cls": MergeConfig, "merge_setting": "merge_lora"},
     r"merge_setting='merge_lora' names no setting of MergeConfig"),
    ("objective", PairsObjective, {"config_cls": PairsConfig, "preference_strength": "beta"},
     r"preference_strength='beta' names no setting of PairsConfig"),
    ("rollout_engine", TurnEngine, {"continuous_batching": True},
     r"ContinuousEngine \(missing: continuous_for, generate_one\), as it declares continuous_batching=True"),
])
def test_a_declaration_the_component_cannot_keep_is_refused_at_registration(kind, obj, flags, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make_component(get_kind(kind), _record(), "thing", obj, **flags)


def test_a_lazy_declaration_is_checked_when_the_component_is_first_used(make_plugin):
    plugins = build_plugin_manager(load_entrypoints=False, builtins=())
    plugins.register(make_plugin("lazy", register_rollout_engines=lambda register: register(
        "broken", f"{HERE}:TurnEngine", continuous_batching=True), register_train_backends=lambda register: register(
        "misnamed", f"{HERE}:ShardingBackend", config_cls=f"{HERE}:ShardConfig", sharding_setting="stage")))
    with pytest.raises(PluginError, match="as it declares continuous_batching=True"):
        plugins.registry("rollout_engine").get("broken")
    with pytest.raises(PluginError, match="sharding_setting='stage' names no setting"):
        plugins.registry("train_backend").component("misnamed").load_config_cls()


def test_an_object_used_by_reference_declares_its_flags_as_class_attributes_checked_the_same_way():
    class Declares(RequestEngine):
        continuous_batching = True

    class Breaks(TurnEngine):
        continuous_batching = True

    kind = get_kind("rollout_engine")
    assert declared_registration(kind, Declares, "m:Declares") == (None, {"needs_gpu": False,
                                                                          "continuous_batching": True})
    with pytest.raises(PluginError, match=r"rollout engine 'm:Breaks' should be a class implementing .*"
                                          r"ContinuousEngine \(missing: continuous_for, generate_one\)"):
        declared_registration(kind, Breaks, "m:Breaks")


# --- continuous_batching=: declared, never probed -------------------------------------------------------


def test_continuous_batching_is_what_the_engine_declared_not_what_it_happens_to_have(third_party):
    engines = third_party.registry("rollout_engine")
    assert engines.component("hf").capabilities["continuous_batching"] is True
    assert engines.component("vllm").capabilities["continuous_batching"] is True
    sampled, greedy = SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=0.0)
    for name, expected in (("requests", True), ("undeclared", False)):
        component = engines.component(name)
        engine = component.load()()
        declared = component.capabilities["continuous_batching"]
        assert batches_continuously(engine, sampled, declared=declared) is expected, name
        assert batches_continuously(engine, greedy, declared=declared) is False, name  # continuous_for declines


# --- environments: optional members read from the class, once ---------------------------------------------


def test_an_environments_optional_members_are_read_from_its_class():
    class Cheap:
        stop = ["\n"]
        blocking = False

        def reset(self, prompt, label):
            return None

        def step(self, action_text):
            return None

        def close(self):
            pass

    class Answers:
        """Answers every attribute (a proxy): it declares none of the optional members."""

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

        def reset(self, prompt, label):
            return None

        def step(self, action_text):
            return None

    assert EnvDeclarations.of(Cheap) == EnvDeclarations(stop=("\n",), blocking=False, closes=True)
    assert EnvDeclarations.of(Answers) == EnvDeclarations(stop=None, blocking=True, closes=False)
