"""User references: registered names, module:attr, file.py:attr, and the click parameter."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from rlhf.cli.main import CliState
from rlhf.cli.params import ComponentParam
from rlhf.core.errors import BadReferenceError, UnknownComponentError
from rlhf.core.plugin_host.references import import_object, is_reference, resolve

pytestmark = pytest.mark.unit


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n\n"
        "class Scorers:\n    @staticmethod\n    def strict(completions):\n        return [0.0] * len(completions)\n"
    )
    return path


def test_is_reference():
    assert is_reference("pkg.mod:attr") and is_reference("dir/file.py") and is_reference("file.py:f")
    assert not is_reference("grpo") and not is_reference("exact_match")


def test_registered_name_resolves_through_the_registry(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin(register_kl_estimators=lambda register: register("k9", abs)))
    resolved = resolve("K9", bare_plugins.registry("kl_estimator"))
    assert resolved.obj is abs and resolved.registered and resolved.ref == "K9"


def test_module_attr_with_a_dotted_attribute():
    assert import_object("os.path:join") is __import__("os").path.join
    assert import_object("collections:OrderedDict.fromkeys") == __import__("collections").OrderedDict.fromkeys


def test_file_with_attr_and_with_default_attr(reward_file):
    assert import_object(f"{reward_file}:Scorers.strict")(["a"]) == [0.0]
    func = resolve(str(reward_file), default_attr="reward_func").obj
    assert func(["q"], ["p"], ["l"]) == [1.0]
    # The same file gives the same module object (pickling and dataclasses rely on it).
    assert import_object(f"{reward_file}:reward_func") is func


def test_missing_file_says_where_it_looked(tmp_path):
    with pytest.raises(BadReferenceError, match="does not exist"):
        import_object(f"{tmp_path}/nope.py:f")


def test_missing_attribute_suggests_close_names(reward_file):
    with pytest.raises(BadReferenceError, match="has no attribute 'reward_fun'; did you mean 'reward_func'"):
        import_object(f"{reward_file}:reward_fun")


def test_missing_module_says_to_install_it():
    with pytest.raises(BadReferenceError, match="cannot import module 'no_such_pkg.sub'.*installed"):
        import_object("no_such_pkg.sub:f")


def test_file_that_raises_while_importing_is_reported(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise ValueError('bad constant')\n")
    with pytest.raises(BadReferenceError, match="running .*broken.py failed: ValueError: bad constant"):
        import_object(f"{path}:f")


def test_reference_without_attribute_and_no_default_is_explained():
    with pytest.raises(BadReferenceError, match="names no attribute"):
        import_object("rewards.py")


def test_unknown_plain_name_is_an_unknown_component(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin(register_kl_estimators=lambda register: register("k3", abs)))
    with pytest.raises(UnknownComponentError, match="Did you mean 'k3'"):
        resolve("k4", bare_plugins.registry("kl_estimator"))


def _command(bare_plugins):
    @click.command()
    @click.option("--kl-estimator", type=ComponentParam("kl_estimator"))
    @click.option("--reward", type=ComponentParam("reward", default_attr="reward_func"))
    @click.pass_context
    def command(ctx, kl_estimator, reward):
        click.echo(f"kl={kl_estimator.ref} reward={reward.ref if reward else None} {reward.registered if reward else ''}")

    def run(args):
        return CliRunner().invoke(command, args, obj=CliState(bare_plugins))

    return run


def test_click_parameter_accepts_names_and_references(make_plugin, bare_plugins, reward_file):
    bare_plugins.register(make_plugin(register_kl_estimators=lambda register: register("k2", abs)))
    result = _command(bare_plugins)(["--kl-estimator", "k2", "--reward", str(reward_file)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"kl=k2 reward={reward_file} False"


def test_click_parameter_unknown_name_is_a_usage_error_listing_choices(make_plugin, bare_plugins):
    bare_plugins.register(make_plugin(register_kl_estimators=lambda register: [register(n, abs) for n in ("k1", "k2", "k3")]))
    result = _command(bare_plugins)(["--kl-estimator", "k5"])
    assert result.exit_code == 2
    assert "Invalid value for '--kl-estimator'" in result.output
    assert "Available: k1, k2, k3." in result.output


def test_click_parameter_bad_reference_is_a_usage_error(bare_plugins):
    result = _command(bare_plugins)(["--reward", "missing_module_xyz:f"])
    assert result.exit_code == 2
    assert "cannot import module 'missing_module_xyz'" in result.output
