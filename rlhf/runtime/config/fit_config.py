"""The configuration of an offline training run (``rlhf fit``, ``rlhf sft``, ``rlhf dpo``, ...).

`FitConfig` is made of the option groups every training command shares (``rlhf.runtime.config.options``:
model, data, optimisation, runtime, output) plus the fit loop's own (epochs, batch size, length
budget, eval). The objective is a component like the backend: ``--objective NAME`` chooses it and
its settings are ``--objective.<field>`` (``components["objective"]``); ``rlhf dpo`` and the other
built-in commands also give them plain flags (``--beta``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlhf.core.errors import ConfigError
from rlhf.runtime.config.options import (MODEL_SLOTS, ConfigBase, DataOptions, EvalOptions, ModelOptions,
                                  OptimOptions, OutputOptions, RuntimeOptions, Slot, best_metric, opt)

FIT_SLOTS: dict[str, Slot] = {**MODEL_SLOTS, "objective": Slot("objective", "objective")}


@dataclass(kw_only=True)
class FitConfig(ModelOptions, DataOptions, OptimOptions, RuntimeOptions, OutputOptions, EvalOptions, ConfigBase):
    SLOTS: ClassVar[dict[str, Slot]] = FIT_SLOTS

    # --- objective --------------------------------------------------------------------------
    objective: str = opt("", "Objective plugin (see `rlhf plugins list --kind objective`; its options: "
                         "--objective.NAME)", "objective", component="objective", required=True)
    teacher: str | None = opt(None, "Teacher model, for objectives that distill one (a local HF directory or a "
                              "hub name)", "model")

    # --- data -------------------------------------------------------------------------------
    max_len: int = opt(2048, "Tokens per sequence at most: prompt + response + EOS (a longer response loses its "
                       "end, EOS kept; a prompt that leaves no room is skipped)", "data")
    eval_split: str = opt("test", "Split to use from --eval-data folders with several splits and hub datasets", "data")

    # --- optimisation -----------------------------------------------------------------------
    epochs: int = opt(1, "Passes over the training data", "train")
    steps: int | None = opt(None, "Optimizer steps (default: --epochs passes over the data)", "train")
    batch_size: int = opt(32, "Examples per optimizer step, over all ranks (a pair counts once)", "train")
    lr: float | None = opt(None, "Peak learning rate (default: the objective's, e.g. 5e-6 for sft, 5e-7 for dpo)",
                           "train")

    def check(self) -> None:
        """Checks that need no data and no model."""
        if not self.model:
            raise ConfigError("--model is required (a local HF model directory or a hub name)")
        if not self.data:
            raise ConfigError("--data is required (a dataset file, folder or hub name)")
        if not self.objective:
            raise ConfigError("--objective is required (see `rlhf plugins list --kind objective`)")
        self.check_prompt_format()
        self.check_loggers()
        self.check_saving()
        self.check_eval_every()
        self.check_data_probs()
        self.check_ring()
        for name, value in (("--batch-size", self.batch_size), ("--micro-batch-size", self.micro_batch_size),
                            ("--epochs", self.epochs)):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1; got {value}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ConfigError(f"--max-tokens-per-micro-batch must be at least 1; got {self.max_tokens_per_micro_batch}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be at least 1; got {self.steps}")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"--lr must be positive; got {self.lr}")
        if self.save_best and not self.eval_data:
            raise ConfigError("--save-best needs --eval-data to score the model on")
        best_metric(self.save_best)
        self.check_aux_loss_coef()
