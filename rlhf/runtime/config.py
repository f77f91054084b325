"""The configuration of a training run: one dataclass, the single source of truth.

Every field becomes an ``rlhf train`` flag (``n_samples`` -> ``--n-samples``) with the field's
help text; ``--config run.yaml`` fills the same fields (flags override the file); the resolved
config is written to the run directory. Derived values are computed in `derived()`, never by
mutating fields.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.rewards.options import RewardOptions

# Nested option groups: their fields become flags with a prefix (RewardOptions.on_error -> --reward-on-error).
NESTED = {"reward_options": ("reward", RewardOptions)}


def _opt(default: Any, help: str, group: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, "group": group, **extra})


def _many(help: str, group: str) -> Any:
    return field(default_factory=list, metadata={"help": help, "group": group, "multiple": True})


@dataclass(kw_only=True)
class TrainConfig:
    # --- model ------------------------------------------------------------------------------
    model: str = _opt("", "Policy model: a local HF directory or a hub name", "model", required=True)
    tokenizer: str | None = _opt(None, "Tokenizer directory or hub name (default: the model's)", "model")
    model_adapter: str = _opt("hf", "Model adapter plugin that builds policy, reference and critic", "model")
    critic_model: str | None = _opt(None, "Critic initialisation: a reward model (its score head becomes the value "
                                    "head) or any model (default: the policy model)", "model")
    dtype: str = _opt("auto", "Weights dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32", "model",
                      choices=("auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"))
    device: str = _opt("auto", "Device for the local runtime: auto, cpu, cuda, cuda:N", "model")
    trust_remote_code: bool = _opt(False, "Allow model code from the checkpoint (only for models you trust)", "model")
    gradient_checkpointing: bool = _opt(False, "Recompute activations in backward to save memory", "model")
    attn_implementation: str = _opt("sdpa", "Attention kernel (flash_attention_2 needs flash-attn and a GPU)", "model",
                                    choices=("sdpa", "eager", "flash_attention_2"))
    chat_template: str | None = _opt(None, "A Jinja file that replaces the tokenizer's chat template", "model")
    lora_rank: int = _opt(0, "LoRA rank r (0: train every weight); the reference is then the base weights with the "
                             "adapter off, not a second copy", "model")
    lora_alpha: int = _opt(16, "LoRA α: the adapter update is scaled by α / r", "model")
    lora_dropout: float = _opt(0.0, "Dropout on the LoRA branch's input", "model")
    target_modules: list[str] = _many("Module names that get LoRA adapters, e.g. q_proj,v_proj (repeatable; default: "
                                      "every linear layer but the output head)", "model")
    load_in_4bit: bool = _opt(False, "QLoRA: hold the frozen weights in 4-bit NF4 (needs --lora-rank, bitsandbytes "
                                     "and a GPU)", "model")
    merge_lora: bool = _opt(False, "With LoRA, also write the merged full model to <out>/final/merged", "model")
    value_head_prefix: str = _opt("score", "Name of the critic's value head, in --critic-model checkpoints and the "
                                           "saved critic (the reward model's: --reward-value-head-prefix)", "model")
    save_critic: bool = _opt(False, "Write the trained critic to <out>/critic at the end (algorithms with a critic)",
                             "model")

    # --- data -------------------------------------------------------------------------------
    data: list[str] = _many("Prompt dataset: .jsonl/.json/.parquet/.csv file, save_to_disk dir or hub name "
                            "(repeatable)", "data")
    data_split: str = _opt("train", "Split to use from folders with several splits and from hub datasets", "data")
    data_probs: str | None = _opt(None, "Mixing probabilities for several --data, e.g. 0.7,0.3", "data")
    input_key: str = _opt("prompt", "Dataset column holding the prompt (a string or chat messages)", "data")
    label_key: str | None = _opt(None, "Dataset column passed to rewards as the label", "data")
    apply_chat_template: bool = _opt(False, "Format prompts with the tokenizer's chat template", "data")
    input_template: str | None = _opt(None, "Template for string prompts, with {} for the prompt", "data")
    max_prompt_length: int = _opt(1024, "Prompt tokens kept (longer prompts lose their start, with a warning)", "data")
    max_samples: int | None = _opt(None, "Use at most this many prompts from each dataset", "data")

    # --- algorithm --------------------------------------------------------------------------
    algo: str = _opt("grpo", "Algorithm preset (see `rlhf plugins list --kind algorithm`)", "algorithm",
                     component="algorithm")
    advantage: str | None = _opt(None, "Override the preset's advantage estimator", "algorithm",
                                 component="advantage_estimator")
    policy_loss: str | None = _opt(None, "Override the preset's policy loss", "algorithm", component="policy_loss")
    kl_estimator: str | None = _opt(None, "Override the preset's KL estimator (k1, k2, k3)", "algorithm",
                                    component="kl_estimator")
    kl_in: str | None = _opt(None, "Where KL goes: reward, loss or none (default: the preset's)", "algorithm",
                             choices=("reward", "loss", "none"))
    kl_coef: float | None = _opt(None, "β, the KL coefficient (default: the preset's; 0 skips the reference model)",
                                 "algorithm")
    loss_agg: str | None = _opt(None, "Override the preset's loss aggregation", "algorithm",
                                component="loss_aggregation")
    gamma: float = _opt(1.0, "γ, discount (forced to 1 by group estimators)", "algorithm")
    lambd: float = _opt(1.0, "λ, GAE trace decay", "algorithm")
    std_norm: bool = _opt(True, "Divide whitened advantages by their std (estimators that whiten)", "algorithm")
    reward_clip: float = _opt(10.0, "Clip shaped rewards to [-c, c]", "algorithm")
    clip_low: float = _opt(0.2, "ε_low, PPO ratio clip below 1", "algorithm")
    clip_high: float = _opt(0.2, "ε_high, PPO ratio clip above 1 (clip-higher: larger than ε_low)", "algorithm")
    dual_clip: float | None = _opt(None, "c > 1 enables dual clip for negative advantages", "algorithm")
    value_clip: float | None = _opt(0.5, "Critic value clip around the old values", "algorithm")
    entropy_coef: float = _opt(0.0, "Entropy bonus coefficient (0: off)", "algorithm")
    algo_config: list[str] = _many("KEY=VALUE for a plugin component's own config field (repeatable)", "algorithm")

    # --- rollout ----------------------------------------------------------------------------
    engine: str = _opt("hf", "Rollout engine plugin", "rollout", component="rollout_engine")
    prompts_per_step: int = _opt(8, "Prompts sampled per training step", "rollout")
    n_samples: int = _opt(8, "Completions per prompt (n, the group size)", "rollout")
    max_new_tokens: int = _opt(256, "Generation budget per completion, in tokens", "rollout")
    temperature: float = _opt(1.0, "Sampling temperature (log-probs are computed at the same temperature)", "rollout")
    top_p: float = _opt(1.0, "Nucleus sampling threshold (1: off)", "rollout")
    generation_batch_size: int | None = _opt(None, "Prompts per generate call (default: all of a step)", "rollout")
    env: str = _opt("single_turn", "Environment for each trajectory: a registered name or module:Class "
                    "(a label with an env_func key picks one per sample)", "rollout", component="env")
    env_config: list[str] = _many("KEY=VALUE for the environment's own config field (repeatable)", "rollout")
    engine_config: list[str] = _many("KEY=VALUE for the rollout engine's own config field, e.g. "
                                     "gpu_memory_utilization=0.4 for --engine vllm (repeatable)", "rollout")
    max_turns: int = _opt(8, "Model turns per trajectory at most (multi-turn environments)", "rollout")
    max_total_tokens: int | None = _opt(None, "Token budget per trajectory: prompt + turns + observations "
                                        "(default: --max-prompt-length + --max-turns x --max-new-tokens)", "rollout")

    # --- rewards ----------------------------------------------------------------------------
    reward: list[str] = _many("Reward source SPEC[@WEIGHT]: a registered name, file.py[:func], module:attr, "
                              "an http(s):// URL or a reward model directory (repeatable)", "reward")
    reward_options: RewardOptions = field(default_factory=RewardOptions, metadata={
        "help": "How reward sources run, time out, retry and fail (flags --reward-<field>)", "group": "reward"})

    # --- optimisation -----------------------------------------------------------------------
    steps: int | None = _opt(None, "Training steps (default: one pass over the data)", "train")
    ppo_epochs: int = _opt(1, "Passes over each rollout batch", "train")
    train_batch_size: int | None = _opt(None, "Samples per optimizer step (default: the whole rollout batch)", "train")
    micro_batch_size: int = _opt(8, "Samples per forward/backward (gradient accumulation inside a step)", "train")
    lr: float = _opt(1e-6, "Policy learning rate", "train")
    critic_lr: float = _opt(9e-6, "Critic learning rate", "train")
    weight_decay: float = _opt(0.0, "AdamW weight decay", "train")
    adam_betas: str = _opt("0.9,0.95", "AdamW betas", "train")
    lr_scheduler: str = _opt("constant", "LR schedule after warmup: constant or cosine (decays to 0.1 x lr)",
                             "train", choices=("constant", "cosine"))
    warmup_ratio: float = _opt(0.0, "Fraction of optimizer steps spent warming up the LR linearly", "train")
    max_grad_norm: float = _opt(1.0, "Clip the global gradient norm (0: off)", "train")
    backend: str = _opt("torch", "Training backend plugin", "train", component="train_backend")
    zero_stage: int = _opt(2, "--backend deepspeed: ZeRO stage, 0 (plain data parallel), 1 (optimizer states "
                           "sharded over ranks), 2 (+ gradients) or 3 (+ parameters)", "train", choices=(0, 1, 2, 3))
    offload_optimizer: bool = _opt(False, "--backend deepspeed: optimizer states and fp32 master weights in CPU "
                                   "memory, stepped by DeepSpeedCPUAdam (ZeRO stages 1-3)", "train")
    offload_params: bool = _opt(False, "--backend deepspeed: parameters in CPU memory between uses (ZeRO stage 3)",
                                "train")
    max_nonfinite_steps: int = _opt(3, "Stop after this many NaN/inf optimizer steps in a row (each is skipped)",
                                    "train")
    seed: int = _opt(42, "Random seed (data order, sampling, initialisation)", "train")

    # --- runtime ----------------------------------------------------------------------------
    runtime: str = _opt("local", "local: every worker in this process (or one data-parallel rank per process "
                        "under torchrun); ray: worker groups as Ray actors", "runtime", choices=("local", "ray"))
    threads: int | None = _opt(None, "CPU threads for torch in each process (default: torch's choice). On a machine "
                               "other jobs share, 1, or start with OMP_WAIT_POLICY=PASSIVE (spinning OpenMP threads "
                               "make steps 20-50x slower there)", "runtime")

    # --- ray (--runtime ray) ----------------------------------------------------------------
    ray_address: str | None = _opt(None, "Join this Ray cluster (host:6379, ray://host:10001 or auto; implies "
                                   "--runtime ray) and ship the current directory to its workers; default: start a "
                                   "local cluster for the run", "ray")
    colocate: str = _opt("none", "Roles that share one actor process (and its device) per rank: none, policy_ref, "
                         "critic_reward, all (every role in the policy actors)", "ray",
                         choices=("none", "policy_ref", "critic_reward", "all"))
    policy_actors: int = _opt(1, "Data-parallel policy actors (torch.distributed: gloo on CPU, nccl on GPU)", "ray")
    policy_gpus: float = _opt(0.0, "GPUs per policy actor", "ray")
    policy_cpus: float = _opt(1.0, "CPUs per policy actor (fractions allowed)", "ray")
    ref_actors: int | None = _opt(None, "Data-parallel reference actors (default: 1; the policy's count when "
                                  "colocated)", "ray")
    ref_gpus: float = _opt(0.0, "GPUs per reference actor", "ray")
    ref_cpus: float = _opt(1.0, "CPUs per reference actor", "ray")
    critic_actors: int | None = _opt(None, "Data-parallel critic actors (default: 1)", "ray")
    critic_gpus: float = _opt(0.0, "GPUs per critic actor", "ray")
    critic_cpus: float = _opt(1.0, "CPUs per critic actor", "ray")
    reward_gpus: float = _opt(0.0, "GPUs for the reward actor (a reward actor of its own is made for reward models, "
                              "for --reward-gpus > 0 and with --colocate critic_reward; else rewards are scored by "
                              "rollout worker 0)", "ray")
    reward_cpus: float = _opt(1.0, "CPUs for the reward actor", "ray")
    rollout_workers: int | None = _opt(None, "Rollout actors; prompts are split over them (default: 1; one per "
                                       "policy actor with --colocate all)", "ray")
    rollout_gpus: float = _opt(0.0, "GPUs per rollout actor", "ray")
    rollout_cpus: float = _opt(1.0, "CPUs per rollout actor", "ray")
    ray_timeout_s: float = _opt(1800.0, "Seconds any remote call (model loading, one fit, one generation) may take "
                                "before the run stops", "ray")
    ray_env: list[str] = _many("KEY=VALUE environment variable for every Ray worker (repeatable; RLHF_LOAD_PLUGINS "
                               "and RLHF_DISABLE_PLUGINS are passed on from this process)", "ray")

    # --- output -----------------------------------------------------------------------------
    out: str | None = _opt(None, "Run directory (default: runs/<date>-<time>)", "output")
    save_every: int = _opt(0, "Checkpoint every N steps (0: only at the end)", "output")
    keep_checkpoints: int = _opt(2, "Checkpoints kept (oldest removed first)", "output")
    resume: bool = _opt(False, "Continue from the latest complete checkpoint in --out", "output")
    log_samples: int | None = _opt(None, "Samples per step written to samples.jsonl (default: all)", "output")
    tensorboard: bool = _opt(False, "Also log metrics to TensorBoard (in <out>/tensorboard)", "output")
    wandb_project: str | None = _opt(None, "Also log to this Weights & Biases project (needs wandb)", "output")
    progress: bool = _opt(True, "Show a progress bar (a plain line per step when not a terminal)", "output")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """From a mapping of field names (nested groups as mappings or as prefixed flat keys)."""
        values = unflatten(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
        for name, (_, group_cls) in NESTED.items():
            if isinstance(values.get(name), dict):
                values[name] = group_cls(**values[name])
        return cls(**values)

    def derived(self) -> Derived:
        """Values computed from the fields (validated here, once)."""
        if not self.model:
            raise ConfigError("--model is required")
        if not self.data:
            raise ConfigError("--data is required (a prompt dataset)")
        if self.prompts_per_step < 1 or self.n_samples < 1 or self.micro_batch_size < 1:
            raise ConfigError("--prompts-per-step, --n-samples and --micro-batch-size must be at least 1")
        rollout = self.prompts_per_step * self.n_samples
        train_batch = self.train_batch_size or rollout
        if rollout % train_batch:
            raise ConfigError(f"--train-batch-size {train_batch} must divide the rollout batch "
                            f"(--prompts-per-step x --n-samples = {rollout})")
        try:
            betas = tuple(float(b) for b in self.adam_betas.split(","))
            assert len(betas) == 2
        except (ValueError, AssertionError):
            raise ConfigError(f"--adam-betas must be two numbers like 0.9,0.95, got {self.adam_betas!r}") from None
        out = Path(self.out) if self.out else Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        return Derived(rollout_batch_size=rollout, train_batch_size=train_batch,
                       optimizer_steps_per_step=self.ppo_epochs * (rollout // train_batch),
                       adam_betas=betas, out_dir=out)


@dataclass(frozen=True)
class Derived:
    rollout_batch_size: int  # samples generated per step
    train_batch_size: int  # samples per optimizer step
    optimizer_steps_per_step: int
    adam_betas: tuple[float, float]
    out_dir: Path


def flat_field_names() -> set[str]:
    """Every name a flag or config key may use: plain fields plus prefixed nested ones."""
    names = {f.name for f in dataclasses.fields(TrainConfig) if f.name not in NESTED}
    for prefix, group_cls in NESTED.values():
        names |= {f"{prefix}_{f.name}" for f in dataclasses.fields(group_cls)}
    return names


def unflatten(values: dict[str, Any]) -> dict[str, Any]:
    """``{"reward_on_error": "skip"}`` -> ``{"reward_options": {"on_error": "skip"}}`` (other keys unchanged)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        for name, (prefix, group_cls) in NESTED.items():
            sub = key.removeprefix(prefix + "_")
            if sub != key and sub in {f.name for f in dataclasses.fields(group_cls)}:
                group = out.setdefault(name, {})
                if isinstance(group, dict):
                    group[sub] = value
                break
        else:
            out[key] = value
    return out


def parse_key_values(items: list[str], flag: str = "--algo-config") -> dict[str, Any]:
    """``["clip=0.3", "mode=tis"]`` -> ``{"clip": 0.3, "mode": "tis"}`` (values parsed as YAML scalars)."""
    import yaml

    values = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        values[key.strip().replace("-", "_")] = yaml.safe_load(raw)
    return values
