"""Plugin discovery from entry points and every way a plugin can be broken."""

from __future__ import annotations

import sys

import pytest

from rlhf.core.errors import ComponentConflictError, UnknownComponentError
from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.helpers import run_cli

pytestmark = pytest.mark.unit

REWARD_PLUGIN = """
    import rlhf

    def {func}(completions, **kwargs):
        '''Scores {func}.'''
        return [0.0 for _ in completions]

    @rlhf.hookimpl
    def register_rewards(register):
        register("{name}", {func})
"""


def reward_plugin(name: str, func: str = "score") -> str:
    return REWARD_PLUGIN.format(name=name, func=func)


def test_fake_dist_info_is_discovered_with_package_and_version(fake_site):
    fake_site.add("rlhf-fake", "0.3.1", {"fake": "rlhf_fake_mod"}, {"rlhf_fake_mod": reward_plugin("fake_score")})
    plugins = build_plugin_manager()
    record = plugins.record("fake")
    assert (record.distribution, record.version, record.source, record.status) == ("rlhf-fake", "0.3.1", "entrypoint", "ok")
    assert plugins.registry("reward").component("fake_score").provider is record
    assert record.provides == {"reward": ["fake_score"]}
    assert record.hooks == ["register_rewards"]


def test_plugin_that_raises_on_import_is_recorded_and_breaks_nothing_else(fake_site):
    fake_site.add("rlhf-broken", "0.2", {"broken": "rlhf_broken_mod"},
                  {"rlhf_broken_mod": "import vllm_that_does_not_exist\n"})
    fake_site.add("rlhf-good", "1.0", {"good": "rlhf_good_mod"}, {"rlhf_good_mod": reward_plugin("good_score")})
    plugins = build_plugin_manager()
    broken = plugins.record("broken")
    assert broken.status == "error"
    assert "No module named 'vllm_that_does_not_exist'" in broken.error
    assert "Traceback" in broken.traceback
    assert plugins.registry("reward").get("good_score") is not None

    assert run_cli(plugins, ["--help"]).exit_code == 0
    listing = run_cli(plugins, ["plugins", "list"])
    assert listing.exit_code == 0
    assert "good_score" in listing.output
    failed_section = listing.output.split("Failed plugins")[1]
    assert "rlhf-broken 0.2 (broken)" in failed_section and "vllm_that_does_not_exist" in failed_section

    # A run that needs an unknown name is told which broken plugin may have provided it.
    with pytest.raises(UnknownComponentError, match=r"rlhf-broken 0\.2 \(broken\).*vllm_that_does_not_exist"):
        plugins.registry("reward").get("fancy_score")


def test_misspelled_hook_is_an_error_with_a_hint(fake_site):
    fake_site.add("rlhf-typo", "0.1", {"typo": "rlhf_typo_mod"}, {"rlhf_typo_mod": """
        import rlhf

        @rlhf.hookimpl
        def register_advantage_estimator(register):
            register("mine", lambda inputs, config: None)
    """})
    record = build_plugin_manager().record("typo")
    assert record.status == "error"
    assert "unknown hook 'register_advantage_estimator'" in record.error
    assert "did you mean 'register_advantage_estimators'" in record.error


def test_hookimpl_with_an_unknown_argument_is_an_error(fake_site):
    fake_site.add("rlhf-extra", "0.1", {"extra": "rlhf_extra_mod"}, {"rlhf_extra_mod": """
        import rlhf

        @rlhf.hookimpl
        def register_rewards(register, config):
            pass
    """})
    plugins = build_plugin_manager()
    record = plugins.record("extra")
    assert record.status == "error"
    assert "config" in record.error and "register_rewards" in record.error
    assert plugins.pm.get_plugin(record.pm_name) is None  # nothing half-registered


def test_hookimpl_argument_with_a_default_gets_a_warning(fake_site):
    fake_site.add("rlhf-default", "0.1", {"default": "rlhf_default_mod"}, {"rlhf_default_mod": """
        import rlhf

        @rlhf.hookimpl
        def on_step_end(step, metrics=None):
            pass
    """})
    record = build_plugin_manager().record("default")
    assert record.status == "ok"
    assert any("metrics" in w and "never passed" in w for w in record.warnings)


def test_two_packages_registering_one_name_is_a_conflict_naming_both(fake_site):
    fake_site.add("rlhf-alpha", "1.0", {"alpha": "rlhf_alpha_mod"}, {"rlhf_alpha_mod": reward_plugin("shared")})
    fake_site.add("rlhf-beta", "2.0", {"beta": "rlhf_beta_mod"}, {"rlhf_beta_mod": """
        import rlhf

        def shared(completions):
            return [1.0] * len(completions)

        def only_beta(completions):
            return [2.0] * len(completions)

        @rlhf.hookimpl
        def register_rewards(register):
            register("shared", shared)
            register("only_beta", only_beta)
    """})
    plugins = build_plugin_manager()
    rewards = plugins.registry("reward")
    with pytest.raises(ComponentConflictError) as info:
        rewards.get("shared")
    assert "rlhf-alpha 1.0 (alpha)" in str(info.value) and "rlhf-beta 2.0 (beta)" in str(info.value)
    assert "shared" not in rewards.names()
    assert rewards.get("only_beta")(["x"]) == [2.0]  # the rest of the plugin still works
    assert plugins.record("alpha").status == plugins.record("beta").status == "conflict"
    assert "[conflict]" in run_cli(plugins, ["plugins", "list"]).output


def test_builtin_and_third_party_with_one_name_conflict(fake_site, make_plugin):
    fake_site.add("rlhf-clash", "0.1", {"clash": "rlhf_clash_mod"}, {"rlhf_clash_mod": reward_plugin("twice")})
    plugins = build_plugin_manager()
    plugins.register(make_plugin("builtin_like", register_rewards=lambda register: register("twice", len)),
                     source="builtin", distribution="rlhf-core", version="0")
    with pytest.raises(ComponentConflictError, match="rlhf-clash 0.1"):
        plugins.registry("reward").get("twice")


def test_same_entry_point_name_in_two_distributions_loads_both_and_warns(fake_site):
    fake_site.add("rlhf-one", "1.0", {"grpo_plus": "rlhf_one_mod"}, {"rlhf_one_mod": reward_plugin("one")})
    fake_site.add("rlhf-two", "1.0", {"grpo_plus": "rlhf_two_mod"}, {"rlhf_two_mod": reward_plugin("two")})
    plugins = build_plugin_manager()
    records = [r for r in plugins.records if r.name == "grpo_plus"]
    assert sorted(r.distribution for r in records) == ["rlhf-one", "rlhf-two"]
    assert all(r.status == "ok" for r in records)
    assert any("also declared by rlhf-two" in w for w in plugins.record("rlhf-one").warnings)
    assert {"one", "two"} <= set(plugins.registry("reward").names())


def test_load_plugins_empty_loads_no_third_party_plugin(fake_site, monkeypatch):
    fake_site.add("rlhf-quiet", "0.1", {"quiet": "rlhf_quiet_mod"}, {"rlhf_quiet_mod": reward_plugin("quiet")})
    monkeypatch.setenv("RLHF_LOAD_PLUGINS", "")
    plugins = build_plugin_manager()
    record = plugins.record("quiet")
    assert record.status == "disabled"
    assert "rlhf_quiet_mod" not in sys.modules
    assert "quiet" not in plugins.registry("reward")


def test_load_plugins_allow_list_by_distribution_name(fake_site, monkeypatch):
    fake_site.add("rlhf-in", "0.1", {"in_": "rlhf_in_mod"}, {"rlhf_in_mod": reward_plugin("inside")})
    fake_site.add("rlhf-out", "0.1", {"out": "rlhf_out_mod"}, {"rlhf_out_mod": reward_plugin("outside")})
    monkeypatch.setenv("RLHF_LOAD_PLUGINS", "rlhf-in")
    plugins = build_plugin_manager(builtins=())  # built-in rewards aside: only the allowed plugin's
    assert plugins.registry("reward").names() == ["inside"]
    assert plugins.record("out").status == "disabled"


def test_disable_plugins_skips_a_plugin(fake_site, monkeypatch):
    fake_site.add("rlhf-off", "0.1", {"off": "rlhf_off_mod"}, {"rlhf_off_mod": reward_plugin("off_score")})
    monkeypatch.setenv("RLHF_DISABLE_PLUGINS", "off")
    plugins = build_plugin_manager()
    assert plugins.record("off").status == "disabled"
    assert "off_score" not in plugins.registry("reward")


def test_disable_plugins_can_turn_off_a_builtin(monkeypatch):
    monkeypatch.setenv("RLHF_DISABLE_PLUGINS", "tests.core.sample_plugin")
    plugins = build_plugin_manager(load_entrypoints=False, builtins=["tests.core.sample_plugin"])
    assert plugins.record("tests.core.sample_plugin").status == "disabled"
    assert len(plugins.registry("reward")) == 0


def test_registration_that_raises_drops_all_of_that_plugins_components(fake_site):
    fake_site.add("rlhf-halfway", "0.1", {"halfway": "rlhf_halfway_mod"}, {"rlhf_halfway_mod": """
        import rlhf

        @rlhf.hookimpl
        def register_kl_estimators(register):
            register("my_kl", lambda logprobs, ref_logprobs: logprobs - ref_logprobs)

        @rlhf.hookimpl
        def register_rewards(register):
            raise RuntimeError("reward server address missing")
    """})
    plugins = build_plugin_manager()
    record = plugins.record("halfway")
    assert "my_kl" not in plugins.registry("kl_estimator")
    assert record.status == "error"
    assert "register_rewards failed: RuntimeError: reward server address missing" in record.error


def test_a_bad_register_call_is_reported_with_the_plugin(make_plugin, plugins):
    record = plugins.register(make_plugin(register_envs=lambda register: register("not_a_class", lambda: None)))
    plugins.registries()
    assert record.status == "error"
    assert "env 'not_a_class' should be a class" in record.error


def test_unknown_capability_flag_is_rejected(make_plugin, plugins):
    plugin = make_plugin(register_advantage_estimators=lambda register: register(
        "typo_flag", lambda inputs, config: None, needs_critc=True))
    record = plugins.register(plugin)
    plugins.registries()
    assert record.status == "error"
    assert "needs_critc" in record.error and "needs_critic" in record.error
