"""Settings of the built-in training backends (no torch here: the command line reads them).

``lr``, ``total_steps`` and ``micro_batch_size`` are run fields (``rlhf.core.plugin_host.settings``): the run
fills them (the policy's ``--lr`` or the critic's ``--critic-lr``, the optimizer steps of the whole
run); everything else is a setting, ``--backend.<name>`` (or its short alias, e.g. ``--zero-stage``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhf.api import ConfigError, run_field

LR_SCHEDULERS = ("constant", "cosine")


@dataclass(kw_only=True)
class BackendConfig:
    lr: float = run_field("lr", 1e-6, "Peak learning rate")
    total_steps: int = run_field("total_steps", 1, "Optimizer steps in the run (for the schedule)")
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay", "range": "[0, inf)"})
    adam_betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={"help": "AdamW betas, e.g. 0.9,0.95",
                                                                                   "range": "[0, 1)"})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon", "range": "(0, inf)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm (0: off)",
                                                         "range": "[0, inf)"})
    lr_scheduler: str = field(default="constant", metadata={
        "help": "LR schedule after warmup: constant, or cosine (decays to min_lr_ratio x lr)"})
    warmup_ratio: float = field(default=0.0, metadata={
        "range": "[0, 1]",
        "help": "Fraction of the run's optimizer steps spent warming the LR up linearly"})
    warmup_steps: int | None = field(default=None, metadata={
        "range": "[0, inf)",
        "help": "Optimizer steps of linear warmup (overrides warmup_ratio)"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Cosine floor as a fraction of lr",
                                                          "range": "[0, 1]"})

    def __post_init__(self) -> None:
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ConfigError(f"--lr-scheduler must be one of {', '.join(LR_SCHEDULERS)}; got {self.lr_scheduler!r}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"--adam-betas must be two numbers in [0, 1) like 0.9,0.95; got {self.adam_betas!r}")
        if not 0 <= self.warmup_ratio <= 1:
            raise ConfigError(f"--warmup-ratio must be in [0, 1]; got {self.warmup_ratio}")
        if not self.lr > 0:
            raise ConfigError(f"the learning rate must be positive; got {self.lr}")

    @property
    def warmup(self) -> int:
        """Optimizer steps of linear warmup."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * self.total_steps)


@dataclass(kw_only=True)
class DeepSpeedConfig(BackendConfig):
    micro_batch_size: int = run_field("micro_batch_size", 1, "Samples per forward/backward on one rank "
                                      "(DeepSpeed's train_micro_batch_size_per_gpu)")
    zero_stage: int = field(default=2, metadata={
        "range": "[0, 3]",
        "help": "ZeRO stage: 0 none, 1 optimizer states sharded over ranks, 2 + gradients, 3 + parameters"})
    offload_optimizer: bool = field(default=False, metadata={
        "help": "Optimizer states and fp32 master weights in CPU memory, stepped by DeepSpeedCPUAdam (stages 1-3)"})
    offload_params: bool = field(default=False, metadata={
        "help": "Parameters in CPU memory between uses (stage 3)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero-stage must be 0, 1, 2 or 3; got {self.zero_stage}")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ConfigError("--offload-optimizer needs ZeRO: add --zero-stage 1, 2 or 3")
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError("--offload-params needs the parameters sharded: add --zero-stage 3")
