"""The configuration of a training run: one dataclass, the single source of truth.

`TrainConfig` holds what is cross-cutting (model, data, batch sizes, the components chosen, output).
Every field becomes an ``rlhf train`` flag (``n_samples`` -> ``--n-samples``) with the field's help
text; ``--config run.yaml`` fills the same fields (flags override the file); the resolved config
is written to the run directory. Derived values are computed in `derived()`, never by mutating
fields.

A component's own settings (its ``config_cls`` fields, ``rlhf.core.settings``) live in
``components``, keyed by the slot that selects the component (`SLOTS`): ``--backend.zero-stage 3``
is ``components["backend"]["zero_stage"] = 3``. The flags these fields had before they moved to
their components stay as aliases (`ALIASES`: ``--zero-stage 3``, ``--lora-rank 16``, ...), in
flags and in config files, so no documented command changes meaning.
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


@dataclass(frozen=True)
class Slot:
    """A place in a run that one component fills: the field naming it and the component's kind."""

    field: str  # the TrainConfig field that selects the component, and the key in ``components``
    kind: str  # the component kind (rlhf.core.kinds)

    @property
    def flag(self) -> str:
        """The selecting flag, also the namespace of the component's own flags (``--backend.zero-stage``)."""
        return "--" + self.field.replace("_", "-")


SLOTS: dict[str, Slot] = {slot.field: slot for slot in (
    Slot("model_adapter", "model"), Slot("advantage", "advantage_estimator"), Slot("policy_loss", "policy_loss"),
    Slot("kl_estimator", "kl_estimator"), Slot("loss_agg", "loss_aggregation"), Slot("engine", "rollout_engine"),
    Slot("env", "env"), Slot("backend", "train_backend"),
)}

# Flags that were TrainConfig fields before they moved to their components: field -> slot.
ALIASES: dict[str, str] = {
    **dict.fromkeys(("gamma", "lambd", "std_norm", "reward_clip"), "advantage"),
    **dict.fromkeys(("clip_low", "clip_high", "dual_clip"), "policy_loss"),
    **dict.fromkeys(("attn_implementation", "gradient_checkpointing", "chat_template", "lora_rank", "lora_alpha",
                     "lora_dropout", "target_modules", "load_in_4bit", "merge_lora", "value_head_prefix"),
                    "model_adapter"),
    "generation_batch_size": "engine",
    **dict.fromkeys(("weight_decay", "adam_betas", "max_grad_norm", "lr_scheduler", "warmup_ratio", "zero_stage",
                     "offload_optimizer", "offload_params"), "backend"),
}
# --algo-config KEY=VALUE looks KEY up in these slots' components (exactly one must have it).
ALGO_CONFIG_SLOTS = ("policy_loss", "advantage", "kl_estimator", "loss_agg", "model_adapter")


def _opt(default: Any, help: str, group: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, "group": group, **extra})


def _many(help: str, group: str) -> Any:
    return field(default_factory=list, metadata={"help": help, "group": group, "multiple": True})


@dataclass(kw_only=True)
class TrainConfig:
    # --- model ------------------------------------------------------------------------------
    model: str = _opt("", "Policy model: a local HF directory or a hub name", "model", required=True)
    tokenizer: str | None = _opt(None, "Tokenizer directory or hub name (default: the model's)", "model")
    model_adapter: str = _opt("hf", "Model adapter plugin that builds policy, reference and critic (its options: "
                              "--model-adapter.NAME, e.g. --lora-rank)", "model", component="model")
    critic_model: str | None = _opt(None, "Critic initialisation: a reward model (its score head becomes the value "
                                    "head) or any model (default: the policy model)", "model")
    dtype: str = _opt("auto", "Weights dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32", "model",
                      choices=("auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"))
    device: str = _opt("auto", "Device for the local runtime: auto, cpu, cuda, cuda:N", "model")
    trust_remote_code: bool = _opt(False, "Allow model code from the checkpoint (only for models you trust)", "model")
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
    value_clip: float | None = _opt(0.5, "Critic value clip around the old values", "algorithm")
    entropy_coef: float = _opt(0.0, "Entropy bonus coefficient (0: off)", "algorithm")
    algo_config: list[str] = _many("KEY=VALUE for an option of the policy loss, advantage estimator, KL estimator, "
                                   "loss aggregation or model adapter, whichever has it (repeatable)", "algorithm")

    # --- rollout ----------------------------------------------------------------------------
    engine: str = _opt("hf", "Rollout engine plugin (its options: --engine.NAME)", "rollout", component="rollout_engine")
    prompts_per_step: int = _opt(8, "Prompts sampled per training step", "rollout")
    n_samples: int = _opt(8, "Completions per prompt (n, the group size)", "rollout")
    max_new_tokens: int = _opt(256, "Generation budget per completion, in tokens", "rollout")
    temperature: float = _opt(1.0, "Sampling temperature (log-probs are computed at the same temperature)", "rollout")
    top_p: float = _opt(1.0, "Nucleus sampling threshold (1: off)", "rollout")
    env: str = _opt("single_turn", "Environment for each trajectory: a registered name or module:Class "
                    "(a label with an env_func key picks one per sample)", "rollout", component="env")
    env_config: list[str] = _many("KEY=VALUE for an option of the environment, like --env.KEY (repeatable)",
                                  "rollout")
    engine_config: list[str] = _many("KEY=VALUE for an option of the rollout engine, like --engine.KEY, e.g. "
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
    backend: str = _opt("torch", "Training backend plugin (its options: --backend.NAME, e.g. --zero-stage)", "train",
                        component="train_backend")
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

    # --- components' own settings -------------------------------------------------------------
    components: dict[str, dict[str, Any]] = field(default_factory=dict, metadata={
        "help": "Settings of the chosen components, by slot: {backend: {zero_stage: 3}, ...} (flags "
                "--<slot>.<option>)", "group": "components"})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """From a mapping of field names. Nested groups may be mappings or prefixed flat keys;
        component settings may be ``components: {slot: {...}}``, dotted keys (``backend.zero_stage``)
        or the short aliases (``zero_stage``)."""
        values = unflatten(dict(values))
        values["components"] = gather_components(values)
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
        out = Path(self.out) if self.out else Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        return Derived(rollout_batch_size=rollout, train_batch_size=train_batch,
                       optimizer_steps_per_step=self.ppo_epochs * (rollout // train_batch), out_dir=out)


@dataclass(frozen=True)
class Derived:
    rollout_batch_size: int  # samples generated per step
    train_batch_size: int  # samples per optimizer step
    optimizer_steps_per_step: int
    out_dir: Path


def gather_components(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pop every component setting out of ``values`` (aliases, dotted keys, the ``components``
    mapping) into ``{slot: {field: value}}``; the same setting given twice with two values is an error."""
    found: dict[str, dict[str, Any]] = {}

    def put(slot: str, name: str, value: Any, how: str) -> None:
        slot, name = slot.replace("-", "_"), name.replace("-", "_")
        if slot not in SLOTS:
            raise ConfigError(f"{how}: no component slot {slot!r}; slots: {', '.join(SLOTS)}")
        settings = found.setdefault(slot, {})
        if name in settings and settings[name] != value:
            raise ConfigError(f"{SLOTS[slot].flag}.{name.replace('_', '-')} is given twice, as {settings[name]!r} "
                              f"and {value!r}")
        settings[name] = value

    nested = values.pop("components", None) or {}
    if not isinstance(nested, dict):
        raise ConfigError(f"components must map slots to settings, got {nested!r}")
    for slot, settings in nested.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"components.{slot} must map option names to values, got {settings!r}")
        for name, value in settings.items():
            put(slot, name, value, f"components.{slot}")
    for key in [k for k in values if "." in k or k in ALIASES]:
        value = values.pop(key)
        slot, _, name = key.partition(".") if "." in key else (ALIASES[key], "", key)
        put(slot, name, value, key)
    return found


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
