"""`--reward SPEC[@WEIGHT]`: the resolution order of docs/rewards.md, weights, names and clear errors."""

from __future__ import annotations

import json

import pytest

from rlhf.core.errors import BadReferenceError, UnknownComponentError
from rlhf.rewards.calling import FunctionSource
from rlhf.rewards.loading import split_weight
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.remote import HttpSource
from rlhf.rewards.reward_model import RewardModelSource
from rlhf.rewards import RewardConfigError, RewardError, load_reward, load_rewards

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("spec, expected", [
    ("exact_match", ("exact_match", 1.0)),
    ("exact_match@0.5", ("exact_match", 0.5)),
    ("my.py:f@-2", ("my.py:f", -2.0)),
    ("http://user@host:8000/reward", ("http://user@host:8000/reward", 1.0)),
    ("http://host:8000/reward@3", ("http://host:8000/reward", 3.0)),
    ("./rm@1e-1", ("./rm", 0.1)),
])
def test_split_weight(spec, expected):
    assert split_weight(spec) == expected


def test_non_finite_weight_is_refused():
    with pytest.raises(RewardError, match="finite"):
        split_weight("exact_match@nan")


def test_url_spec_with_several_urls(plugins):
    source = load_reward("http://127.0.0.1:9/a, http://localhost:10/b", plugins=plugins)
    assert isinstance(source, HttpSource)
    assert source.urls == ["http://127.0.0.1:9/a", "http://localhost:10/b"]
    assert source.name == "127.0.0.1"


def test_bad_url_is_refused(plugins):
    with pytest.raises(RewardConfigError, match="not an http"):
        load_reward("http://ok:1/x,ftp://bad", plugins=plugins)


def test_registered_name_wins_over_a_directory_of_that_name(plugins, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exact_match").mkdir()
    (tmp_path / "exact_match" / "config.json").write_text("{}")
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert isinstance(load_reward("exact_match", plugins=plugins), FunctionSource)
    model = load_reward("rm", plugins=plugins)
    assert isinstance(model, RewardModelSource) and model.name == "rm"


def test_file_and_module_specs(plugins, tmp_path):
    (tmp_path / "mine.py").write_text("def reward_func(completions):\n    return [1.0] * len(completions)\n"
                                      "def other(completions):\n    return [2.0] * len(completions)\n")
    assert load_reward(str(tmp_path / "mine.py"), plugins=plugins).score(["p"], ["c"]) == [1.0]
    named = load_reward(f"{tmp_path / 'mine.py'}:other", plugins=plugins)
    assert (named.name, named.score(["p"], ["c"])) == ("other", [2.0])
    assert "mine.py" in named.where
    module = load_reward("rlhf.plugins.rewards.math_answer:boxed_math", plugins=plugins)
    assert module.name == "boxed_math"


def test_unknown_name_suggests_and_lists_the_forms(plugins):
    with pytest.raises(UnknownComponentError, match=r"Did you mean 'exact_match'.*file\.py\[:func\]"):
        load_reward("exact_matc", plugins=plugins)


def test_directory_without_config_is_explained(plugins, tmp_path):
    with pytest.raises(RewardConfigError, match="holds no config.json"):
        load_reward(str(tmp_path), plugins=plugins)


def test_missing_attribute_is_a_bad_reference(plugins, tmp_path):
    (tmp_path / "mine.py").write_text("def scorer(completions):\n    return [0.0]\n")
    with pytest.raises(BadReferenceError, match="no attribute 'reward_func'"):
        load_reward(str(tmp_path / "mine.py"), plugins=plugins)


def test_not_callable_is_refused(plugins):
    with pytest.raises(RewardConfigError, match="not a function"):
        load_reward("rlhf.plugins.rewards.builtin:THINK_FORMAT", plugins=plugins)


def test_load_reward_refuses_a_weight(plugins):
    with pytest.raises(RewardConfigError, match="load_rewards"):
        load_reward("exact_match@2", plugins=plugins)


def test_unknown_option_lists_valid_ones(plugins):
    with pytest.raises(RewardError, match="unknown reward option.*timout_s.*valid:.*timeout_s"):
        load_rewards(["exact_match"], plugins=plugins, timout_s=1)


def test_bad_option_values_are_refused():
    with pytest.raises(RewardError, match="on_error must be one of raise, zero, skip"):
        RewardOptions(on_error="ignore")
    with pytest.raises(RewardError, match="timeout_s must be a positive number"):
        RewardOptions(timeout_s=0)


def test_reward_options_fields_all_have_help():
    from dataclasses import fields

    assert all(f.metadata.get("help") for f in fields(RewardOptions))


def test_default_plugin_set_is_built_lazily():
    import rlhf.core.plugin_host.loading as core

    core._installed = None
    assert load_reward("exact_match").score(["p"], ["a"], ["a"]) == [1.0]
    assert core._installed is not None
