"""Settings of the built-in objectives (no torch here: the command line reads them).

Each field is ``--objective.<name>`` on ``rlhf fit`` and a plain flag on the objective's own
command (``rlhf dpo --beta 0.1``). Column options name dataset columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.api import ConfigError


def _opt(default, help: str, range: str | None = None):
    return field(default=default, metadata={"help": help, **({"range": range} if range else {})})


@dataclass(kw_only=True)
class SFTConfig:
    input_key: str = _opt("prompt", "Column with the prompt (a string or chat messages); with --multiturn or no "
                          "--output-key, the whole conversation")
    output_key: str | None = _opt("response", "Column with the response (a string or messages); '' or none: the "
                                  "last message of the --input-key conversation is the response")
    multiturn: bool = _opt(False, "Learn every assistant turn of the --input-key conversation, not only the last "
                           "(needs --apply-chat-template)")
    pretrain_mode: bool = _opt(False, "Learn every token of --input-key (continued pretraining: no template, no EOS "
                               "appended)")


@dataclass(kw_only=True)
class PairConfig:
    """Columns of preference pairs (reward models, DPO)."""

    prompt_key: str | None = _opt(None, "Column with the prompt (default: 'prompt' when the data has it; without "
                                  "one, chosen and rejected are whole conversations or complete texts)")
    chosen_key: str = _opt("chosen", "Column with the preferred response (a string or a conversation)")
    rejected_key: str = _opt("rejected", "Column with the dispreferred response (a string or a conversation)")


REWARD_MODEL_LOSSES = ("sigmoid", "logexp")


@dataclass(kw_only=True)
class RewardModelConfig(PairConfig):
    loss: str = _opt("sigmoid", "Pairwise loss: sigmoid (-log σ(r_c - r_r - margin)) or logexp (log(1 + exp(r_r - "
                     "r_c)))")
    margin_key: str | None = _opt(None, "Column with a margin per pair, subtracted inside the sigmoid loss")
    normalize_reward: bool = _opt(False, "Store the mean and std of the trained model's scores over the training "
                                  "set in its config.json; reward sources then score (r - mean) / std")

    def __post_init__(self) -> None:
        if self.loss not in REWARD_MODEL_LOSSES:
            raise ConfigError(f"--loss must be one of {', '.join(REWARD_MODEL_LOSSES)}; got {self.loss!r}")
        if self.margin_key and self.loss != "sigmoid":
            raise ConfigError("--margin-key works with --loss sigmoid only (logexp takes no margin)")


@dataclass(kw_only=True)
class DPOConfig(PairConfig):
    beta: float = _opt(0.1, "β: strength of the implicit KL to the reference (IPO: its 1/(2β) target margin)",
                       "(0, inf)")
    label_smoothing: float = _opt(0.0, "ε of conservative DPO (cDPO): the share of pairs assumed mislabelled",
                                  "[0, 0.5)")
    ipo: bool = _opt(False, "IPO: the squared loss (h - 1/(2β))² instead of -log σ(βh)")
    nll_coef: float = _opt(0.0, "Weight of an NLL term on the chosen responses (per-token mean), added to the loss",
                           "[0, inf)")

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"--beta must be positive; got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label-smoothing must be in [0, 0.5); got {self.label_smoothing}")
        if self.ipo and self.label_smoothing:
            raise ConfigError("--ipo and --label-smoothing do not combine (IPO has no label smoothing)")


@dataclass(kw_only=True)
class KTOConfig:
    prompt_key: str = _opt("prompt", "Column with the prompt (a string or chat messages)")
    output_key: str = _opt("completion", "Column with the completion (a string or messages)")
    label_key: str = _opt("label", "Column with the label: true/1 desirable, false/0 undesirable")
    beta: float = _opt(0.1, "β: strength of the implicit KL to the reference", "(0, inf)")
    desirable_weight: float = _opt(1.0, "Weight of the desirable samples' losses", "[0, inf)")
    undesirable_weight: float = _opt(1.0, "Weight of the undesirable samples' losses", "[0, inf)")

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"--beta must be positive; got {self.beta}")


@dataclass(kw_only=True)
class PRMConfig:
    input_key: str = _opt("input", "Column with the solution text, a placeholder token after each step")
    label_key: str = _opt("label", "Column with one label per placeholder: reward tokens (e.g. + and -) or "
                          "probabilities of the first reward token")
    placeholder_token: str = _opt("ки", "The token after each step whose prediction is the step's label (one token "
                                  "of the tokenizer)")
    reward_tokens: list[str] | None = _opt(None, "The label tokens, e.g. + - (default: any token; two are needed for "
                                    "probability labels)")


@dataclass(kw_only=True)
class DistillConfig:
    input_key: str = _opt("prompt", "Column with the prompt (a string or chat messages)")
    output_key: str | None = _opt("response", "Column with the response (a string or messages); '' or none: the "
                                  "last message of the --input-key conversation")
    kd_coef: float = _opt(0.4, "Weight of the distillation term: loss = (1 - kd) x SFT + kd x KD", "[0, 1]")

    def __post_init__(self) -> None:
        if not 0 <= self.kd_coef <= 1:
            raise ConfigError(f"--kd-coef must be in [0, 1]; got {self.kd_coef}")
