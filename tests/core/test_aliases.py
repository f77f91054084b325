"""Aliases: other names of one registered component (``register(..., aliases=...)``), for any plugin.

The built-in estimators answer to OpenRLHF's ``--advantage_estimator`` names; an alias that another
registration also claims is a conflict, reported like two plugins registering one name.
"""

from __future__ import annotations

import json

import pytest

from rlhf.core.errors import ComponentConflictError, UnknownComponentError
from tests.helpers import run_cli


def _estimator(inputs, config):
    """A do-nothing estimator."""
    return inputs.action_mask, inputs.action_mask


@pytest.mark.unit
def test_an_alias_looks_up_the_same_component_under_its_own_name(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin(register_advantage_estimators=lambda register: register(
        "median_baseline", _estimator, aliases=("Median-Base", "mb"))))
    registry = bare_plugins.registry("advantage_estimator")
    component = registry.component("median_baseline")
    assert registry.component("median-base") is component and registry.component("MB") is component
    assert component.name == "median_baseline" and component.aliases == ("median_base", "mb")
    assert registry.names() == ["median_baseline"]  # names are names; aliases are listed apart
    assert registry.aliases() == {"mb": "median_baseline", "median_base": "median_baseline"}
    assert "mb" in registry and "median_baseline" in registry
    assert registry.components() == [component]  # one registration, however many names


@pytest.mark.unit
@pytest.mark.parametrize("aliases, message", [
    (("bad:alias",), "invalid alias 'bad:alias' of advantage estimator 'own'"),
    (("Own",), "alias 'Own' repeats its name"),
    (("x", "X"), "alias 'X' repeats another alias"),
])
def test_bad_aliases_are_refused_at_registration(make_plugin, bare_plugins, aliases, message):
    record = bare_plugins.register(make_plugin("rlhf_bad_alias", register_advantage_estimators=lambda register: (
        register("own", _estimator, aliases=aliases))))
    bare_plugins.registries()
    assert record.status == "error" and message in record.error


@pytest.mark.unit
def test_an_alias_that_is_another_components_name_is_a_conflict_naming_both(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin("rlhf_alpha", register_advantage_estimators=lambda register: register(
        "alpha_pp", _estimator, aliases=("shared",))))
    bare_plugins.register(make_plugin("rlhf_beta", register_advantage_estimators=lambda register: register(
        "shared", _estimator)))
    registry = bare_plugins.registry("advantage_estimator")
    with pytest.raises(ComponentConflictError) as info:
        registry.component("shared")
    message = str(info.value)
    assert "advantage estimator 'shared' is provided by several plugins" in message
    assert "rlhf_alpha, as an alias of 'alpha_pp'" in message and "  - rlhf_beta\n" in message
    assert registry.component("alpha_pp").name == "alpha_pp"  # its own name still works
    assert registry.names() == ["alpha_pp"] and registry.aliases() == {}
    for name in ("rlhf_alpha", "rlhf_beta"):
        assert bare_plugins.record(name).status == "conflict"
    assert any("'shared' (alias of 'alpha_pp') is also claimed by rlhf_beta" in w
               for w in bare_plugins.record("rlhf_alpha").warnings)
    assert any("'shared' is also claimed by rlhf_alpha, as an alias of 'alpha_pp'" in w
               for w in bare_plugins.record("rlhf_beta").warnings)
    listing = run_cli(bare_plugins, ["plugins", "list", "--all"]).output
    assert "alpha_pp (alias: shared [conflict])" in listing and "shared [conflict]" in listing


@pytest.mark.unit
def test_two_aliases_alike_conflict_and_the_order_of_registration_does_not_matter(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin("rlhf_one", register_advantage_estimators=lambda register: register(
        "one", _estimator, aliases=("same",))))
    bare_plugins.register(make_plugin("rlhf_two", register_advantage_estimators=lambda register: register(
        "two", _estimator, aliases=("same",))))
    registry = bare_plugins.registry("advantage_estimator")
    with pytest.raises(ComponentConflictError, match=r"rlhf_one, as an alias of 'one'\n  - rlhf_two, as an alias"):
        registry.component("same")
    assert registry.names() == ["one", "two"]


@pytest.mark.unit
def test_unknown_names_suggest_aliases_too(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin(register_advantage_estimators=lambda register: register(
        "reinforce_pp_baseline", _estimator, aliases=("reinforce_baseline",))))
    with pytest.raises(UnknownComponentError) as info:
        bare_plugins.registry("advantage_estimator").component("reinforce_baselin")
    assert info.value.suggestions[0] == "reinforce_baseline"
    assert "Available: reinforce_pp_baseline (aliases: reinforce_baseline)." in str(info.value)


# --- the built-in aliases: OpenRLHF's estimator names -------------------------------------------

OPENRLHF_NAMES = {"reinforce": "reinforce_pp", "reinforce_baseline": "reinforce_pp_baseline", "group_norm": "grpo"}


@pytest.mark.unit
def test_the_builtin_estimators_answer_to_openrlhfs_names(plugins):
    assert plugins.registry("advantage_estimator").aliases() == OPENRLHF_NAMES


@pytest.mark.unit
@pytest.mark.parametrize("alias", sorted(OPENRLHF_NAMES))
def test_an_alias_gives_exactly_the_advantages_of_the_builtin_it_names(plugins, alias):
    import torch

    from rlhf.algorithms import compute_advantages

    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(12, generator=generator)  # (B,) 3 prompts x 4 samples
    action_mask = (torch.rand(12, 7, generator=generator) > 0.3).float()  # (B, A) ragged
    kl = torch.randn(12, 7, generator=generator) * 0.1  # (B, A)
    sample_mask = torch.ones(12)  # (B,)
    sample_mask[5] = 0
    for options in ({}, {"kl": kl, "kl_coef": 0.05, "sample_mask": sample_mask}):
        by_alias = compute_advantages(alias, rewards=rewards, action_mask=action_mask, group_size=4,
                                      plugins=plugins, **options)
        by_name = compute_advantages(OPENRLHF_NAMES[alias], rewards=rewards, action_mask=action_mask, group_size=4,
                                     plugins=plugins, **options)
        assert by_alias[0].abs().sum() > 0
        for got, expected in zip(by_alias, by_name):
            assert torch.equal(got, expected)


def _whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    var = ((values - mean) ** 2 * mask).sum() / mask.sum()
    return (values - mean) / var.clamp(min=1e-8).sqrt() * mask


@pytest.mark.unit
@pytest.mark.parametrize("alias", sorted(OPENRLHF_NAMES))
def test_each_alias_is_openrlhfs_estimator_of_that_name(plugins, alias):
    """OpenRLHF's definitions, written out by hand (γ = 1, no KL): ``group_norm`` = (r - mean) / (std + 1e-9)
    per group; ``reinforce_baseline`` = r - mean per group, then whitened over the batch's tokens;
    ``reinforce`` = r, whitened over the batch's tokens."""
    import torch

    from rlhf.algorithms import compute_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0, 1.0, 3.0], dtype=torch.float64)  # (B,) 2 prompts x 4
    lengths = torch.tensor([3, 1, 2, 4, 2, 2, 1, 3])
    action_mask = (torch.arange(4)[None, :] < lengths[:, None]).double()  # (B, A)
    groups = rewards.view(2, 4)  # (G, n)
    if alias == "group_norm":
        shaped = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-9)).reshape(-1)
        expected = shaped[:, None] * action_mask
    elif alias == "reinforce_baseline":
        shaped = (groups - groups.mean(-1, keepdim=True)).reshape(-1)
        expected = _whiten(shaped[:, None] * action_mask, action_mask)
    else:
        expected = _whiten(rewards[:, None] * action_mask, action_mask)
    advantages, _ = compute_advantages(alias, rewards=rewards, action_mask=action_mask, group_size=4, plugins=plugins)
    assert torch.allclose(advantages, expected, rtol=0, atol=1e-12)


@pytest.mark.unit
def test_plugins_show_and_list_name_the_aliases(plugins):
    shown = run_cli(plugins, ["plugins", "show", "group-norm"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.startswith("advantage_estimator grpo\n  aliases:     group_norm")
    assert "selected by: --advantage grpo, --advantage group_norm" in shown.output
    listing = run_cli(plugins, ["plugins", "list", "--all", "--kind", "advantage_estimator"]).output
    assert "reinforce_pp (alias: reinforce)" in listing
    record = run_cli(plugins, ["plugins", "show", "rlhf.plugins.algorithms.plugin"]).output
    assert "aliases:  advantage_estimator: group_norm = grpo, reinforce = reinforce_pp" in record
    as_json = json.loads(run_cli(plugins, ["plugins", "list", "--all", "--json"]).output)
    builtin = next(r for r in as_json if r["name"] == "rlhf.plugins.algorithms.plugin")
    assert builtin["aliases"] == {"advantage_estimator": OPENRLHF_NAMES}
    typo = run_cli(plugins, ["plugins", "show", "group_nrm"])
    assert typo.exit_code == 2 and "did you mean 'group_norm'" in typo.output


@pytest.mark.run
def test_a_run_given_an_alias_uses_and_logs_the_builtin(tiny_model_dir, task, tmp_path, plugins):
    """Through the real command line: ``--advantage reinforce_baseline`` trains with
    reinforce_pp_baseline, exactly as the name itself does (same metrics, same weights)."""
    import torch

    from tests.helpers import final_weights, read_jsonl

    outputs = {}
    for name in ("reinforce_baseline", "reinforce_pp_baseline"):
        out = tmp_path / name
        result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                                   "--reward", str(task / "rewards.py"), "--advantage", name, "--prompts-per-step",
                                   "2", "--n-samples", "2", "--max-new-tokens", "3", "--steps", "1", "--seed", "5",
                                   "--lr", "1e-3", "--no-progress", "--out", str(out)])
        assert result.exit_code == 0, result.output
        outputs[name] = out
    rows = {name: [{k: v for k, v in row.items() if not k.startswith(("throughput/", "time/", "perf/"))}
                   for row in read_jsonl(out / "metrics.jsonl")] for name, out in outputs.items()}
    assert rows["reinforce_baseline"] == rows["reinforce_pp_baseline"]
    assert rows["reinforce_baseline"][0]["policy/grad_norm"] > 0  # the step trained
    weights = {name: final_weights(out) for name, out in outputs.items()}
    for key, tensor in weights["reinforce_pp_baseline"].items():
        assert torch.equal(weights["reinforce_baseline"][key], tensor), key
    assert "advantage `reinforce_pp_baseline`" in (outputs["reinforce_baseline"] / "final" / "README.md").read_text()


@pytest.mark.unit
def test_a_mistyped_estimator_is_a_usage_error_suggesting_the_alias(tiny_model_dir, task, tmp_path, plugins):
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--reward", str(task / "rewards.py"), "--advantage", "group_nrm", "--out",
                               str(tmp_path / "run")])
    assert result.exit_code == 2 and "Did you mean 'group_norm'?" in result.output


@pytest.mark.unit
def test_a_new_plugin_named_like_an_alias_is_warned_about(plugins, tmp_path):
    result = run_cli(plugins, ["plugins", "new", "advantage_estimator", "group_norm", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "Warning: rlhf-core" in result.output and "advantage estimator called 'group_norm'" in result.output
