"""Registers the built-in objectives of the fit loop (imported lazily: this module stays
torch-free). Each also gets its own command (``rlhf sft``, ``rlhf dpo``, ...), whose help shows
the registered ``example``; ``dpo`` declares ``beta`` its preference strength (``rlhf iterate``)."""

from rlhf.api import hookimpl

_CONFIG = "rlhf.plugins.objectives.config:"


@hookimpl
def register_objectives(register):
    register("sft", "rlhf.plugins.objectives.sft:SFTObjective", config_cls=_CONFIG + "SFTConfig", default_lr=5e-6,
             command=True, description="Supervised fine-tuning: next-token loss on the responses",
             example="rlhf sft --model ./base --data sft.jsonl --input-key prompt --output-key response --out runs/sft")
    register("rm", "rlhf.plugins.objectives.reward_model:RewardModelObjective", config_cls=_CONFIG + "RewardModelConfig",
             head="score", default_lr=9e-6, command=True,
             description="Reward model on preference pairs (pairwise sigmoid or logexp loss)",
             example="rlhf rm --model runs/sft/final --data pairs.jsonl --chosen-key chosen --rejected-key rejected "
                     "--out runs/rm")
    register("dpo", "rlhf.plugins.objectives.dpo:DPOObjective", config_cls=_CONFIG + "DPOConfig",
             needs_reference=True, default_lr=5e-7, command=True, preference_strength="beta",
             description="Direct Preference Optimization against a frozen reference (IPO, cDPO, NLL term)",
             example="rlhf dpo --model runs/sft/final --data pairs.jsonl --beta 0.1 --out runs/dpo")
    register("kto", "rlhf.plugins.objectives.kto:KTOObjective", config_cls=_CONFIG + "KTOConfig",
             needs_reference=True, default_lr=5e-7, command=True,
             description="Kahneman-Tversky Optimization on unpaired desirable / undesirable completions",
             example="rlhf kto --model runs/sft/final --data kto.jsonl --output-key completion --label-key label "
                     "--out runs/kto")
    register("prm", "rlhf.plugins.objectives.prm:PRMObjective", config_cls=_CONFIG + "PRMConfig", default_lr=1e-6,
             command=True, description="Process reward model: a label per solution step at placeholder tokens",
             example="rlhf prm --model ./base --data steps.jsonl --placeholder-token 'ки' --reward-tokens + - "
                     "--out runs/prm")
    register("distill", "rlhf.plugins.objectives.distill:DistillObjective", config_cls=_CONFIG + "DistillConfig",
             needs_teacher=True, default_lr=5e-6, command=True,
             description="Knowledge distillation from --teacher (token-level KL) plus the SFT loss",
             example="rlhf distill --model ./student --teacher runs/sft/final --data sft.jsonl --out runs/kd")
