"""The agent and tool-parser kinds: registered through their hooks like any component, selected by
``--agent`` / ``--tool-parser`` (a registered name, or ``file.py:fn`` without a plugin), every agent's
settings including ``--agent.timeout-s``, and listed by ``rlhf plugins``."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf.core.errors import ConfigError
from rlhf.core.protocols.agent import AgentConfig, AgentResult, as_agent_result
from tests.helpers import run_cli

pytestmark = pytest.mark.unit


def answer(sample, endpoint):
    return 1.0


@dataclasses.dataclass(kw_only=True)
class Patient(AgentConfig):
    turns: int = dataclasses.field(default=3, metadata={"help": "how many turns"})


def test_hook_register_agents(bare_plugins, make_plugin):
    record = bare_plugins.register(make_plugin("agents_plugin", register_agents=lambda register: register(
        "answer", answer, config_cls=Patient)))
    component = bare_plugins.registry("agent").component("answer")
    assert record.status == "ok" and record.provides == {"agent": ["answer"]}
    assert component.load() is answer and component.load_config_cls() is Patient


def test_hook_register_tool_parsers(bare_plugins, make_plugin):
    from rlhf.api import ParsedTurn

    def plain(text):
        return ParsedTurn(content=text)

    record = bare_plugins.register(make_plugin("parsers_plugin", register_tool_parsers=lambda register: register(
        "plain", plain)))
    assert record.status == "ok" and bare_plugins.registry("tool_parser").component("plain").load()("x").content == "x"


def test_what_an_agent_may_return():
    assert as_agent_result(2) == AgentResult(reward=2.0)
    assert as_agent_result(None) == AgentResult()
    kept = AgentResult(reward=0.5, info={"turns": 3})
    assert as_agent_result(kept) is kept
    with pytest.raises(ValueError, match="not a finite number"):
        as_agent_result(float("nan"))
    with pytest.raises(TypeError, match="float, an AgentResult or None"):
        as_agent_result("1.0")
    with pytest.raises(TypeError):
        as_agent_result(True)


def _plan(plugins, tmp_path, **values):
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.config.train_plan import RunPlan

    config = TrainConfig.from_dict({"model": "m", "data": ["d.jsonl"], "out": str(tmp_path), **values}, plugins)
    return RunPlan.make(config, plugins)


def test_an_agent_by_reference_gets_the_settings_every_agent_has(plugins, tmp_path):
    agent_file = tmp_path / "agent.py"
    agent_file.write_text("def solve(sample, endpoint):\n    return 1.0\n")
    plan = _plan(plugins, tmp_path, agent=f"{agent_file}:solve", components={"agent": {"timeout_s": 12}})
    assert plan.component_config("agent") == AgentConfig(timeout_s=12.0)
    assert plan.choices["tool_parser"].name == "hermes"
    with pytest.raises(ConfigError, match="timeout-s must be positive"):
        _plan(plugins, tmp_path, agent=f"{agent_file}:solve", components={"agent": {"timeout_s": 0}})


def test_a_registered_agent_with_its_own_settings(plugins, make_plugin, tmp_path):
    plugins.register(make_plugin("agents_plugin", register_agents=lambda register: register(
        "patient", answer, config_cls=Patient)))
    plan = _plan(plugins, tmp_path, agent="patient", components={"agent": {"turns": 5, "timeout_s": 9}})
    assert plan.component_config("agent") == Patient(turns=5, timeout_s=9.0)


def test_an_agent_config_class_must_subclass_agent_config(plugins, make_plugin, tmp_path):
    @dataclasses.dataclass(kw_only=True)
    class Alone:
        turns: int = 1

    plugins.register(make_plugin("agents_plugin", register_agents=lambda register: register(
        "alone", answer, config_cls=Alone)))
    with pytest.raises(ConfigError, match="must subclass rlhf.api.AgentConfig"):
        _plan(plugins, tmp_path, agent="alone")


def test_the_cli_lists_shows_and_takes_the_new_kinds(plugins):
    listed = run_cli(plugins, ["plugins", "list", "--all", "--kind", "tool_parser"])
    assert listed.exit_code == 0 and "hermes" in listed.output
    shown = run_cli(plugins, ["plugins", "show", "hermes"])
    assert "selected by: --tool-parser hermes" in shown.output
    helped = run_cli(plugins, ["train", "--help"])
    assert "--agent TEXT" in helped.output or "--agent " in helped.output
    assert "--agent.timeout-s" in helped.output and "--tool-parser" in helped.output
