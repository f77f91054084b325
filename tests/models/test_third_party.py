"""A model adapter from a third-party plugin, selected by name (the README's worked example)."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.core.errors import UnknownComponentError
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.rl.local import train
from tests.helpers import run_cli
from tests.models import freeze_plugin

REWARD = "def reward_func(completions):\n    return [len(c) / 10 for c in completions]\n"


@pytest.fixture
def task(tmp_path):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"What is {a} + 1?"}) + "\n" for a in range(4)))
    (tmp_path / "rewards.py").write_text(REWARD)
    return tmp_path


@pytest.mark.run
def test_a_plugin_adapter_is_selected_by_name_and_gets_its_own_option(plugins, tiny_model_dir, task):
    from transformers import AutoModelForCausalLM

    plugins.register(freeze_plugin)
    component = plugins.registry("model").component("freeze_last")
    assert component.load() is freeze_plugin.FreezeAdapter and component.capabilities["roles"][0] == "policy"
    out = task / "run"
    train(TrainConfig.from_dict(dict(
        model=str(tiny_model_dir), data=[str(task / "data.jsonl")], reward=[str(task / "rewards.py")],
        model_adapter="freeze_last", algo_config=["train_last_layers=1"], prompts_per_step=2, n_samples=2,
        max_new_tokens=4, micro_batch_size=4, steps=1, lr=1e-2, out=str(out), progress=False)), plugins=plugins)

    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(n.startswith(("model.layers.1.", "lm_head.")) for n in changed)  # layer 0 frozen
    assert "lm_head.weight" in changed


@pytest.mark.unit
def test_an_unknown_adapter_name_lists_the_installed_ones(plugins):
    with pytest.raises(UnknownComponentError, match="Did you mean 'lora'.*Available: hf, lora"):
        plugins.registry("model").component("loraa")


@pytest.mark.unit
def test_plugins_list_shows_builtin_and_plugin_adapters(plugins):
    plugins.register(freeze_plugin)
    result = run_cli(plugins, ["plugins", "list", "--all", "--kind", "model", "--json"])
    assert result.exit_code == 0, result.output
    provided = {row["name"]: row["provides"]["model"] for row in json.loads(result.output)}
    assert provided["rlhf.plugins.models.plugin"] == ["hf", "lora"]
    assert provided[freeze_plugin.__name__] == ["freeze_last"]


@pytest.mark.unit
def test_the_readme_example_is_the_code_the_tests_run():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    for name in ("plugin.py", "adapter.py"):
        example = readme.split(f"# rlhf_freeze/{name}\n", 1)[1].split("```", 1)[0].strip()
        source = (root / "examples" / "plugins" / "rlhf-freeze" / "rlhf_freeze" / name).read_text()
        assert source.strip() == example, f"README's rlhf_freeze/{name} and examples/plugins/rlhf-freeze differ"
