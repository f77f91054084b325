"""Options of ``rlhf generate``, ``rlhf score`` and ``rlhf iterate`` (docs/generate.md), one dataclass each.

They are built from the option groups every command shares (``rlhf.runtime.config.options``: model,
data, runtime) plus their own; each field is one flag (``max_new_tokens`` -> ``--max-new-tokens``)
and a key of ``--config run.yaml``. The rollout engine is a component like the model adapter:
``--engine NAME`` picks it and its settings are ``--engine.<setting>``. Reward sources use the
``rlhf train`` syntax (``--reward SPEC[@WEIGHT]``, ``--reward-on-error``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlhf.core.errors import ConfigError
from rlhf.rewards.options import RewardOptions
from rlhf.runtime.config.options import (MODEL_SLOTS, ConfigBase, DataOptions, ModelOptions, RuntimeOptions,
                                  Slot, check_sampling, many, opt)

GENERATE_SLOTS: dict[str, Slot] = {"model_adapter": MODEL_SLOTS["model_adapter"],
                                   "engine": Slot("engine", "rollout_engine")}
NESTED = {"reward_options": ("reward", RewardOptions)}
MODES = ("samples", "best_of_n", "pairs", "conditional")
DEFAULT_REWARD_TEMPLATE = "{input} <rm_score>: {reward} "  # OpenRLHF's conditional SFT prompt


@dataclass(kw_only=True)
class SelectOptions:
    """What one output row holds: every sample (default) or one selection per prompt."""

    best_of_n: bool = opt(False, "Rejection sampling: one row per prompt {prompt, response, reward} with the "
                          "highest-reward sample (rlhf sft --output-key response data)", "output")
    pairs: bool = opt(False, "One row per prompt {prompt, chosen, rejected, chosen_reward, rejected_reward}: the "
                      "highest- vs the lowest-reward sample (rlhf dpo data); prompts whose samples all tie are "
                      "skipped and counted", "output")
    conditional: bool = opt(False, "Conditional SFT: rows {prompt, response, reward} whose prompt carries the "
                            "sample's score through --reward-template", "output")
    conditional_rows: str = opt("prompt", "With --conditional: 'prompt' writes one row per prompt (one sample "
                                "drawn at random, seeded), 'sample' one row per sample", "output",
                                choices=("prompt", "sample"))
    reward_template: str = opt(DEFAULT_REWARD_TEMPLATE, "With --conditional: the prompt written, with {input} for "
                               "the prompt and {reward} for the score (2 decimals); for chat prompts it "
                               "rewrites the last user message", "output")

    @property
    def mode(self) -> str:
        chosen = [name for name in ("best_of_n", "pairs", "conditional") if getattr(self, name)]
        if len(chosen) > 1:
            raise ConfigError("--best-of-n, --pairs and --conditional are alternatives; pick one: "
                              + ", ".join("--" + c.replace("_", "-") for c in chosen))
        if self.conditional and ("{input}" not in self.reward_template or "{reward}" not in self.reward_template):
            raise ConfigError(f"--reward-template must contain {{input}} and {{reward}}: {self.reward_template!r}")
        return chosen[0] if chosen else "samples"


@dataclass(kw_only=True)
class RewardArgs:
    reward: list[str] = many("Reward source SPEC[@WEIGHT]: a registered name, file.py[:func], module:attr, an "
                             "http(s):// URL or a reward model directory (repeatable; the total is the weighted sum)",
                             "reward")
    reward_options: RewardOptions = field(default_factory=RewardOptions, metadata={
        "help": "How reward sources run, time out, retry and fail (flags --reward-<field>)", "group": "reward"})


@dataclass(kw_only=True)
class PromptKeys:
    input_key: str = opt("prompt", "Dataset column holding the prompt (a string or chat messages)", "data")
    label_key: str | None = opt(None, "Dataset column passed to rewards as the label (written as \"label\")", "data")


@dataclass(kw_only=True)
class SamplingOptions:
    engine: str = opt("hf", "Rollout engine plugin: hf, or vllm on a GPU (its options: --engine.NAME)", "sampling",
                      component="rollout_engine")
    n: int = opt(8, "Samples per prompt", "sampling")
    max_new_tokens: int = opt(256, "Generation budget per sample, in tokens", "sampling")
    max_prompt_length: int = opt(1024, "Prompt tokens kept (longer prompts lose their start, with a warning)",
                                 "sampling")
    temperature: float = opt(1.0, "Sampling temperature (0: greedy)", "sampling")
    top_p: float = opt(1.0, "Nucleus sampling threshold (1: off)", "sampling")
    top_k: int = opt(0, "Sample among the k most likely tokens only (0: off)", "sampling")
    repetition_penalty: float = opt(1.0, "Penalty on tokens the sequence holds already, as in transformers (1: off)",
                                    "sampling")
    seed: int = opt(42, "Random seed: the same seed, data and --batch-size give the same output", "sampling")
    batch_size: int = opt(16, "Prompts generated (and written) together; a killed run resumes after the last "
                          "whole batch", "sampling")

    def check_sampling_options(self) -> None:
        """The sampling options every sampling job checks before anything loads."""
        for name, value in (("--n", self.n), ("--max-new-tokens", self.max_new_tokens),
                            ("--batch-size", self.batch_size), ("--max-prompt-length", self.max_prompt_length)):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1; got {value}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"--temperature must be >= 0 (0: greedy) and --top-p in (0, 1]; got {self.temperature}, "
                              f"{self.top_p}")
        check_sampling(self.top_k, self.repetition_penalty)


@dataclass(kw_only=True)
class GenerateConfig(ModelOptions, DataOptions, PromptKeys, SamplingOptions, RewardArgs, SelectOptions,
                     RuntimeOptions, ConfigBase):
    SLOTS: ClassVar[dict[str, Slot]] = GENERATE_SLOTS
    NESTED: ClassVar[dict[str, tuple[str, type]]] = NESTED

    out: str = opt("", "Output JSONL file (a rerun with the same --out continues it)", "output", required=True)
    overwrite: bool = opt(False, "Start --out afresh instead of continuing it", "output")
    progress: bool = opt(True, "Show a progress bar (a plain line per batch when not a terminal)", "output")

    def check(self) -> str:
        """Checks that need no data and no model; returns the output mode."""
        if not self.model:
            raise ConfigError("--model is required (a local HF model directory or a hub name)")
        if not self.data:
            raise ConfigError("--data is required (a prompt dataset file, folder or hub name)")
        if not self.out:
            raise ConfigError("--out is required (the output .jsonl file)")
        self.check_prompt_format()
        self.check_sampling_options()
        mode = self.mode
        if mode != "samples" and not self.reward:
            raise ConfigError(f"--{mode.replace('_', '-')} ranks samples by reward: add --reward SPEC")
        if mode == "pairs" and self.n < 2:
            raise ConfigError("--pairs needs at least two samples per prompt: --n 2 or more")
        return mode


@dataclass(kw_only=True)
class ScoreConfig(DataOptions, PromptKeys, RewardArgs, SelectOptions, RuntimeOptions, ConfigBase):
    SLOTS: ClassVar[dict[str, Slot]] = {}
    NESTED: ClassVar[dict[str, tuple[str, type]]] = NESTED

    completions_key: str = opt("completions", "Column holding the completions: a list (scored into \"rewards\") or "
                               "one string (scored into \"reward\")", "data")
    tokenizer: str | None = opt(None, "Tokenizer whose chat template --apply-chat-template uses (the prompt text "
                                "rewards see)", "data")
    batch_size: int = opt(64, "Rows scored (and written) together; a killed run resumes after the last whole batch",
                          "data")
    out: str = opt("", "Output JSONL file (a rerun with the same --out continues it)", "output", required=True)
    overwrite: bool = opt(False, "Start --out afresh instead of continuing it", "output")
    progress: bool = opt(True, "Show a progress bar (a plain line per batch when not a terminal)", "output")
    seed: int = opt(42, "Seed of --conditional-rows prompt's random pick", "output")

    def check(self) -> str:
        if not self.data:
            raise ConfigError("--data is required (a JSONL file of prompts and completions, e.g. from rlhf generate)")
        if not self.reward:
            raise ConfigError("--reward is required (what scores the completions)")
        if not self.out:
            raise ConfigError("--out is required (the output .jsonl file)")
        self.check_prompt_format()
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1; got {self.batch_size}")
        if self.apply_chat_template and not self.tokenizer:
            raise ConfigError("--apply-chat-template needs --tokenizer (the chat template is the tokenizer's)")
        return self.mode


@dataclass(kw_only=True)
class IterateConfig(ModelOptions, DataOptions, PromptKeys, SamplingOptions, RewardArgs, RuntimeOptions, ConfigBase):
    SLOTS: ClassVar[dict[str, Slot]] = GENERATE_SLOTS
    NESTED: ClassVar[dict[str, tuple[str, type]]] = NESTED

    rounds: int = opt(3, "Rounds of generate -> score -> pairs -> dpo", "iterate")
    prompts_per_round: int | None = opt(None, "Prompts sampled per round, taken in order and wrapping around "
                                        "(default: every prompt each round)", "iterate")
    objective: str = opt("dpo", "The objective each round trains on its pairs: any registered with a preference "
                         "strength (rlhf plugins show NAME)", "dpo")
    beta: float = opt(0.1, "DPO β: the objective's preference strength", "dpo")
    lr: float = opt(5e-7, "DPO learning rate", "dpo")
    epochs: int = opt(1, "DPO passes over each round's pairs", "dpo")
    dpo_batch_size: int = opt(32, "DPO pairs per optimizer step", "dpo")
    micro_batch_size: int = opt(8, "DPO pairs per forward/backward", "dpo")
    max_len: int = opt(2048, "DPO tokens per sequence at most (prompt + response + EOS)", "dpo")
    dpo_config: list[str] = many("KEY=VALUE for any other `rlhf dpo` option, e.g. backend=deepspeed, "
                                 "label_smoothing=0.1, lora_rank=16 (repeatable)", "dpo")
    out: str = opt("", "Run directory: round_1/, round_2/, ... each with its data and model; a rerun continues "
                   "after the last complete round", "output", required=True)
    progress: bool = opt(True, "Show progress bars", "output")

    def check(self) -> None:
        if not self.model or not self.data or not self.out:
            raise ConfigError("--model, --data and --out are required")
        if not self.reward:
            raise ConfigError("--reward is required (what ranks each round's samples into pairs)")
        self.check_prompt_format()
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be at least 1; got {self.rounds}")
        if self.n < 2:
            raise ConfigError("iterative DPO needs at least two samples per prompt: --n 2 or more")
        if self.prompts_per_round is not None and self.prompts_per_round < 1:
            raise ConfigError(f"--prompts-per-round must be at least 1; got {self.prompts_per_round}")


@dataclass(kw_only=True)
class EvalConfig(ModelOptions, DataOptions, PromptKeys, SamplingOptions, RewardArgs, RuntimeOptions, ConfigBase):
    SLOTS: ClassVar[dict[str, Slot]] = GENERATE_SLOTS
    NESTED: ClassVar[dict[str, tuple[str, type]]] = NESTED

    json: bool = opt(False, "Print one JSON object of the metrics instead of the table", "output")
    out: str | None = opt(None, "Also write one JSONL row per sample (prompt, completion, rewards, label) here",
                          "output")

    def check(self) -> None:
        """Checks that need no data and no model."""
        if not self.model or not self.data:
            raise ConfigError("--model and --data are required")
        if not self.reward:
            raise ConfigError("--reward is required (what scores the samples)")
        self.check_prompt_format()
        self.check_sampling_options()
