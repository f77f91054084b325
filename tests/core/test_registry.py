"""Registries: names, descriptions, capability flags, lazy references, helpful lookups."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pytest

from rlhf.core.errors import PluginError, UnknownComponentError
from rlhf.core.types import AlgorithmPreset

pytestmark = pytest.mark.unit


def test_names_are_case_insensitive_and_dash_equals_underscore(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin(register_kl_estimators=lambda register: register("My-KL", abs)))
    registry = bare_plugins.registry("kl_estimator")
    assert registry.names() == ["my_kl"]
    assert registry.get("MY_KL") is abs and registry.get("my-kl") is abs


def test_description_defaults_to_the_first_docstring_line(make_plugin, bare_plugins):
    def estimator(inputs, config):
        """Leave-one-out baseline.

        More text that is not shown in listings.
        """

    def register(register):
        register("documented", estimator)
        register("explicit", estimator, description="Said explicitly")

    bare_plugins.register(make_plugin(register_advantage_estimators=register))
    registry = bare_plugins.registry("advantage_estimator")
    assert registry.component("documented").description == "Leave-one-out baseline."
    assert registry.component("explicit").description == "Said explicitly"


def test_preset_description_comes_from_the_preset(make_plugin, bare_plugins):
    preset = AlgorithmPreset(advantage="grpo", description="Group-normalised advantages")
    bare_plugins.register(make_plugin(register_algorithms=lambda register: register("my_algo", preset)))
    assert bare_plugins.registry("algorithm").component("my_algo").description == "Group-normalised advantages"


def test_capability_flags_have_defaults_and_can_be_set(make_plugin, bare_plugins):
    def register(register):
        register("plain", lambda inputs, config: None)
        register("critic_based", lambda inputs, config: None, needs_critic=True)

    bare_plugins.register(make_plugin(register_advantage_estimators=register))
    registry = bare_plugins.registry("advantage_estimator")
    assert registry.component("plain").capabilities == {"needs_critic": False, "needs_groups": False,
                                                         "supports_masking": False, "implements": None}
    assert registry.component("critic_based").capabilities["needs_critic"] is True


def test_config_class_is_kept_with_the_component(make_plugin, bare_plugins):
    @dataclass(kw_only=True)
    class ClipConfig:
        clip: float = field(default=0.2, metadata={"help": "ε, the clip range"})

    bare_plugins.register(make_plugin(register_policy_losses=lambda register: register(
        "clipped", lambda inputs, config: None, config_cls=ClipConfig)))
    assert bare_plugins.registry("policy_loss").component("clipped").load_config_cls() is ClipConfig


def test_a_config_class_that_cannot_hold_settings_is_refused_at_registration(make_plugin, bare_plugins):
    class NotADataclass:
        clip: float = 0.2

    record = bare_plugins.register(make_plugin("rlhf_odd_config", register_policy_losses=lambda register: register(
        "odd", lambda inputs, config: None, config_cls=NotADataclass)))
    bare_plugins.registries()
    assert record.status == "error" and "policy loss 'odd': config_cls should be a dataclass" in record.error


def test_a_lazy_config_class_is_checked_when_it_is_loaded(fake_site, make_plugin, bare_plugins):
    fake_site.add("rlhf-lazy-config", "0.1", {}, {"rlhf_lazy_config": "class Settings:\n    clip = 0.2\n"})
    bare_plugins.register(make_plugin("rlhf_lazy_config_plugin", register_policy_losses=lambda register: register(
        "lazy_config", lambda inputs, config: None, config_cls="rlhf_lazy_config:Settings")))
    with pytest.raises(PluginError, match="config_cls 'rlhf_lazy_config:Settings' should be a dataclass"):
        bare_plugins.registry("policy_loss").component("lazy_config").load_config_cls()


def test_lazy_reference_is_imported_only_on_lookup(fake_site, make_plugin, bare_plugins):
    fake_site.add("rlhf-lazy", "0.1", {}, {"rlhf_lazy_impl": """
        def score(completions):
            '''Heavy to import.'''
            return [3.0] * len(completions)
    """})
    bare_plugins.register(make_plugin(register_rewards=lambda register: register(
        "lazy_score", "rlhf_lazy_impl:score", description="Imported on first use")))
    component = bare_plugins.registry("reward").component("lazy_score")
    assert "rlhf_lazy_impl" not in sys.modules
    assert component.description == "Imported on first use"
    assert component.load()(["a", "b"]) == [3.0, 3.0]
    assert "rlhf_lazy_impl" in sys.modules


def test_broken_lazy_reference_names_its_plugin(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin("rlhf_flaky", register_rewards=lambda register: register(
        "flaky", "rlhf_module_that_is_missing:score")))
    with pytest.raises(PluginError, match=r"reward 'flaky' from rlhf_flaky could not be imported"):
        bare_plugins.registry("reward").get("flaky")


def test_lazy_reference_to_the_wrong_type_is_an_error(fake_site, make_plugin, bare_plugins):
    fake_site.add("rlhf-wrongtype", "0.1", {}, {"rlhf_wrong_type": "NOT_A_CLASS = 3\n"})
    bare_plugins.register(make_plugin(register_envs=lambda register: register("wrong", "rlhf_wrong_type:NOT_A_CLASS")))
    with pytest.raises(PluginError, match="env 'wrong' .* should be a class, got int"):
        bare_plugins.registry("env").get("wrong")


def test_unknown_name_suggests_close_names(make_plugin, bare_plugins):
    def register(register):
        for name in ("grpo", "dr_grpo", "rloo"):
            register(name, lambda inputs, config: None)

    bare_plugins.register(make_plugin(register_advantage_estimators=register))
    with pytest.raises(UnknownComponentError) as info:
        bare_plugins.registry("advantage_estimator").get("gpro")
    assert info.value.suggestions[0] == "grpo"
    assert "Did you mean 'grpo'" in str(info.value)
    assert "Available: dr_grpo, grpo, rloo." in str(info.value)
    assert "rlhf plugins list" in str(info.value)


@pytest.mark.parametrize("bad_name", ["my:name", "path/name", "", "-leading"])
def test_invalid_names_are_rejected(make_plugin, bare_plugins, bad_name):
    record = bare_plugins.register(make_plugin(register_kl_estimators=lambda register: register(bad_name, abs)))
    bare_plugins.registries()
    assert record.status == "error" and "invalid kl estimator name" in record.error


def test_inline_plugin_can_be_unregistered(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin("temporary", register_kl_estimators=lambda register: register("tmp", abs)))
    assert "tmp" in bare_plugins.registry("kl_estimator")
    bare_plugins.unregister("temporary")
    assert "tmp" not in bare_plugins.registry("kl_estimator")
