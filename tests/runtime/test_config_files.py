"""``--config`` files and option values given as YAML are read safely (rlhf/core/inputs/safe_yaml.py): nested
aliases (a "billion laughs") and python tags are refused as the file is read, every value is checked
against its option's type (rlhf/cli/options.py: config_value_problem), and a ``--reward`` file that is
a symlink loop is named: one line each, exit 2, never a traceback."""

from __future__ import annotations

import resource
import time

import pytest

from rlhf.cli.options import Flag, config_value_problem
from rlhf.core.errors import ConfigError
from rlhf.core.inputs.safe_yaml import MAX_ALIASES, load_yaml
from rlhf.runtime.config.options import parse_key_values
from tests.helpers import run_cli

pytestmark = pytest.mark.unit


def laughs(levels: int = 9, width: int = 9) -> str:
    """Each level a list of ``width`` aliases of the one before: width ** levels strings."""
    parts = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    parts += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "data: [" + ", ".join(parts) + "]\n"


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


def train(tmp_path, *extra):
    return ["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"), "--out",
            str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("text", [laughs(), laughs(levels=8, width=8)],
                         ids=["81 aliases", "8 levels of 8: under the alias bound, 16 million values"])
def test_a_billion_laughs_config_is_refused_as_it_is_read(text, tmp_path, plugins):
    (tmp_path / "laughs.yaml").write_text(text)
    cpu = time.process_time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = one_error_line(run_cli(plugins, train(tmp_path, "--config", str(tmp_path / "laughs.yaml"))))
    assert time.process_time() - cpu < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB: no expansion
    assert f"cannot read {tmp_path / 'laughs.yaml'}: more than" in line and "aliases" in line


def test_yaml_that_contains_itself_or_names_python_is_refused():
    with pytest.raises(ConfigError, match=r"^f.yaml: a value contains itself \(through an alias\)"):
        load_yaml("a: &x [1, *x]", "f.yaml")
    with pytest.raises(ConfigError, match=r"could not determine a constructor for the tag .*python/object/apply"):
        load_yaml("a: !!python/object/apply:os.system ['echo hi']", "f.yaml")
    assert load_yaml("base: &b {lr: 0.1}\nother: *b\n", "f.yaml") == {"base": {"lr": 0.1}, "other": {"lr": 0.1}}
    assert load_yaml("x: &a 1\ny: [" + ", ".join(["*a"] * MAX_ALIASES) + "]", "f")["y"] == [1] * MAX_ALIASES
    with pytest.raises(ConfigError, match=f"more than {MAX_ALIASES} aliases"):
        load_yaml("x: &a 1\ny: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]", "f.yaml")
    with pytest.raises(ConfigError, match=r"^--algo-config k=\[1: .* \(line 1, column \d+\)$"):
        parse_key_values(["k=[1"])


@pytest.mark.parametrize("line, key, must", [
    ("steps: [1, 2]", "steps", "a whole number, not [1, 2]"),
    ("lr: {a: 1}", "lr", "a number, not {'a': 1}"),
    ("lr: fast", "lr", "a number, not 'fast'"),
    ("steps: 1.5", "steps", "a whole number, not 1.5"),
    ("steps: true", "steps", "a whole number, not True"),
    ("trust_remote_code: 1", "trust_remote_code", "true or false, not 1"),
    ("data: {train: x.jsonl}", "data", "a list of values (text or numbers), not {'train': 'x.jsonl'}"),
    ("model: [a, b]", "model", "a single value, not ['a', 'b']"),
    ("backend.zero_stage: [3]", "backend.zero_stage", "a whole number, not [3]"),
])
def test_a_value_of_the_wrong_shape_is_one_line_naming_the_option(line, key, must, tmp_path, plugins):
    (tmp_path / "run.yaml").write_text(line + "\n")
    error = one_error_line(run_cli(plugins, train(tmp_path, "--config", str(tmp_path / "run.yaml"))))
    assert error.endswith(f"{tmp_path / 'run.yaml'}: {key} must be {must}"), error


def test_values_click_converts_from_text_fit_their_option():
    number = Flag(dest="lr", names=("--lr",), hint=float, help="")
    whole = Flag(dest="steps", names=("--steps",), hint=int | None, help="")
    assert [config_value_problem(number, v) for v in (1e-3, "1e-3", 3, None)] == [None] * 4
    assert [config_value_problem(whole, v) for v in (5, "5", 2.0, None)] == [None] * 4
    many = Flag(dest="data", names=("--data",), hint=list[str], help="", multiple=True)
    assert config_value_problem(many, "one.jsonl") is None and config_value_problem(many, ["a", "b"]) is None
    assert config_value_problem(many, [["a"]]) == "a list of values (text or numbers)"


def test_a_reward_file_that_is_a_symlink_loop_is_one_line(tmp_path, plugins):
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "r1.py").symlink_to(tmp_path / "r2.py")
    (tmp_path / "r2.py").symlink_to(tmp_path / "r1.py")
    line = one_error_line(run_cli(plugins, train(tmp_path, "--reward", str(tmp_path / "r1.py"), "--label-key",
                                                 "answer")))
    assert f"file '{tmp_path / 'r1.py'}' cannot be read: it is a symbolic link that leads back to itself" in line
