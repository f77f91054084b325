"""A third-party reward shaping and sample filter get the command line the built-ins get: short
flags declared at registration (``--short-bonus`` as ``--overlong-buffer``), a shaping turned on by
its flag (``enabled_by``), the settings in config files, in config.yaml and in ``from_dict``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import yaml

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.config.train_config import TrainConfig
from tests.helpers import read_jsonl, run_cli


@dataclass(kw_only=True)
class ShortBonusConfig:
    short_bonus: float | None = field(default=None, metadata={"help": "Reward added to a short completion"})
    short_length: int = field(default=2, metadata={"help": "Policy tokens a completion may have to count as short"})

    def __post_init__(self):
        if self.short_bonus is not None and self.short_bonus < 0:
            raise ValueError(f"--short-bonus must be at least 0; got {self.short_bonus}")


def short_bonus(trajectories, rewards, config):
    bonus = [config.short_bonus if t.num_policy_tokens <= config.short_length else 0.0 for t in trajectories]
    shaped = [r + b if r is not None else None for r, b in zip(rewards, bonus)]
    return shaped, {"short_bonus/given": sum(b > 0 for b in bonus) / max(len(bonus), 1)}


@dataclass(kw_only=True)
class ParityConfig:
    keep_parity: str = field(default="odd", metadata={"help": "odd or even: the answers whose groups are kept"})


def answer_parity(groups, config):
    want = 1 if config.keep_parity == "odd" else 0
    return [int(group[0].columns["answer"]) % 2 == want for group in groups]


def register_reward_shapings(register):
    register("short_bonus", short_bonus, config_cls=ShortBonusConfig, short_flags=("short_bonus", "short_length"),
             enabled_by="short_bonus")


def register_sample_filters(register):
    register("answer_parity", answer_parity, config_cls=ParityConfig, short_flags=("keep_parity",))


@pytest.fixture
def third_party(make_plugin):
    plugins = build_plugin_manager()
    plugins.register(make_plugin("third_party", register_reward_shapings=register_reward_shapings,
                                 register_sample_filters=register_sample_filters))
    return plugins


def _args(tiny_model_dir, task, out, *more):
    return ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(task / "rewards.py"), "--prompts-per-step", "2", "--n-samples", "2",
            "--max-new-tokens", "4", "--steps", "2", "--lr", "1e-3", "--out", str(out), "--no-progress", *more]


@pytest.mark.unit
def test_the_help_lists_third_party_short_flags_beside_the_builtins(third_party):
    text = run_cli(third_party, ["train", "--help"]).output
    for flag in ("--short-bonus", "--reward-shaping.short-bonus", "--short-length", "--keep-parity",
                 "--sample-filter.keep-parity", "--overlong-buffer", "--reward-shaping.overlong-buffer",
                 "--filter-range", "--zero-stage", "--lora-rank"):
        assert flag in text, flag


@pytest.mark.run
def test_a_third_party_shaping_and_filter_run_from_their_short_flags(third_party, tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    result = run_cli(third_party, _args(tiny_model_dir, task, out, "--short-bonus", "0.5", "--short-length", "3",
                                        "--sample-filter", "answer_parity", "--keep-parity", "even",
                                        "--max-filter-rounds", "10"))
    assert result.exit_code == 0, result.output
    samples = read_jsonl(out / "samples.jsonl")
    assert samples and all(int(s["label"]) % 2 == 0 for s in samples)  # the filter kept even answers only
    for sample in samples:  # the shaping ran, with both settings
        bonus = 0.5 if sample["completion_tokens"] <= 3 else 0.0
        assert sample["reward"] == pytest.approx(sample["rewards"]["reward_func"] + bonus)
    assert all("short_bonus/given" in m for m in read_jsonl(out / "metrics.jsonl"))
    recorded = yaml.safe_load((out / "config.yaml").read_text())["components"]
    assert recorded["reward_shaping"] == {"short_bonus": 0.5, "short_length": 3}
    assert recorded["sample_filter"] == {"keep_parity": "even"}
    again = TrainConfig.from_dict(yaml.safe_load((out / "config.yaml").read_text()), third_party)
    assert again.components["reward_shaping"] == {"short_bonus": 0.5, "short_length": 3}


@pytest.mark.run
def test_without_its_flag_the_shaping_stays_off(third_party, tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    result = run_cli(third_party, _args(tiny_model_dir, task, out))
    assert result.exit_code == 0, result.output
    assert all(s["reward"] == pytest.approx(s["rewards"]["reward_func"]) for s in read_jsonl(out / "samples.jsonl"))
    assert not any("short_bonus/given" in m for m in read_jsonl(out / "metrics.jsonl"))


@pytest.mark.unit
def test_short_flags_in_a_config_file_and_in_from_dict(third_party, tmp_path):
    config = TrainConfig.from_dict({"model": "m", "data": ["d"], "short_bonus": 0.25, "keep_parity": "even",
                                    "overlong_buffer": 2, "zero_stage": 3}, third_party)
    assert config.components == {"reward_shaping": {"short_bonus": 0.25, "overlong_buffer": 2},
                                 "sample_filter": {"keep_parity": "even"}, "backend": {"zero_stage": 3}}
    with pytest.raises(ConfigError, match="unknown config key.*short_bonus"):  # not without the plugin
        TrainConfig.from_dict({"model": "m", "data": ["d"], "short_bonus": 0.25}, build_plugin_manager())


@pytest.mark.run
def test_a_config_file_sets_a_third_party_short_flag(third_party, tiny_model_dir, task, tmp_path):
    out = tmp_path / "run"
    path = tmp_path / "run.yaml"
    path.write_text("short_bonus: 1.0\nshort_length: 8\n")
    result = run_cli(third_party, _args(tiny_model_dir, task, out, "--config", str(path), "--steps", "1"))
    assert result.exit_code == 0, result.output
    assert all(s["reward"] == pytest.approx(s["rewards"]["reward_func"] + 1.0)
               for s in read_jsonl(out / "samples.jsonl"))


@pytest.mark.unit
def test_a_bad_value_is_the_plugins_own_usage_error(third_party, tiny_model_dir, task, tmp_path):
    result = run_cli(third_party, _args(tiny_model_dir, task, tmp_path / "a", "--short-bonus", "-1"))
    assert result.exit_code == 2 and "the 'short_bonus' reward shaping: --short-bonus must be at least 0" in \
        result.output
    result = run_cli(third_party, _args(tiny_model_dir, task, tmp_path / "b", "--overlong-buffer", "9"))
    assert result.exit_code == 2 and "--overlong-buffer must be in [1, --max-new-tokens 4]; got 9" in result.output
    result = run_cli(third_party, _args(tiny_model_dir, task, tmp_path / "c", "--filter-groups",
                                        "--filter-range", "0.9", "0.1"))
    assert result.exit_code == 2 and "--filter-range needs LO < HI" in result.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.unit
def test_short_flags_must_name_settings_and_never_shadow_an_option(make_plugin):
    def bad(register):
        register("typo", short_bonus, config_cls=ShortBonusConfig, short_flags=("short_bonus", "bonus"))

    def shadowing(register):  # --lr is the run's; --clip-high is the ppo loss's
        @dataclass(kw_only=True)
        class Shadow:
            lr: float = 1.0
            clip_high: float = 0.1

        register("shadow", short_bonus, config_cls=Shadow, short_flags=("lr", "clip_high"))

    plugins = build_plugin_manager()
    plugins.register(make_plugin("typo", register_reward_shapings=bad))
    plugins.register(make_plugin("shadow", register_reward_shapings=shadowing))
    assert "typo" not in plugins.registry("reward_shaping")
    assert "short_flags bonus are not settings of ShortBonusConfig" in plugins.record("typo").error
    aliases = TrainConfig.short_flags(plugins)
    assert "lr" not in aliases and aliases["clip_high"] == "policy_loss"
    assert any("--clip-high" in w and "--reward-shaping.clip-high" in w for w in plugins.record("shadow").warnings)
