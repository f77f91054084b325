"""The configuration of a training run: one dataclass, the single source of truth.

`TrainConfig` holds what is cross-cutting (model, data, batch sizes, the components chosen, output):
the option groups every training command shares (``rlhf.runtime.config.options``) plus the RL loop's own.
Every field becomes an ``rlhf train`` flag (``n_samples`` -> ``--n-samples``) with the field's help
text; ``--config run.yaml`` fills the same fields (flags override the file); the resolved config
is written to the run directory. Derived values are computed in `derived()`, never by mutating
fields.

A component's own settings (its ``config_cls`` fields, ``rlhf.core.plugin_host.settings``) live in
``components``, keyed by the slot that selects the component (`SLOTS`): ``--backend.zero-stage 3``
is ``components["backend"]["zero_stage"] = 3``. The reward shapings of a run share one namespace,
``--reward-shaping.<setting>`` (`SETTING_SLOTS`). Short flags (``--zero-stage 3``, ``--lora-rank
16``, ``--overlong-buffer 8``) are what the registered components declare (``short_flags``), the
built-ins as any plugin: the host keeps no list of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from rlhf.core.errors import ConfigError
from rlhf.rewards.options import RewardOptions
from rlhf.runtime.config.options import (MODEL_SLOTS, ConfigBase, DataOptions, EvalOptions, ModelOptions, check_sampling,
                                  OptimOptions, OutputOptions, RuntimeOptions, Slot, best_metric, parse_key_values)
from rlhf.runtime.config.options import many as _many
from rlhf.runtime.config.options import opt as _opt

__all__ = ["ALGO_CONFIG_SLOTS", "COLOCATE_CHOICES", "COLOCATE_PAIRS", "DEFAULT_SAMPLE_FILTER", "NESTED",
           "SETTING_SLOTS", "SLOTS", "Derived", "Slot", "TrainConfig", "colocation", "parse_key_values"]

# Nested option groups: their fields become flags with a prefix (RewardOptions.on_error -> --reward-on-error).
NESTED = {"reward_options": ("reward", RewardOptions)}

SLOTS: dict[str, Slot] = {**MODEL_SLOTS, **{slot.field: slot for slot in (
    Slot("advantage", "advantage_estimator"), Slot("policy_loss", "policy_loss"),
    Slot("kl_estimator", "kl_estimator"), Slot("loss_agg", "loss_aggregation"), Slot("engine", "rollout_engine"),
    Slot("env", "env"), Slot("sample_filter", "sample_filter"), Slot("agent", "agent"),
    Slot("tool_parser", "tool_parser"),
)}}

# The namespaces of component settings: every slot, and the reward shapings of the run, which share
# one (``--reward-shaping.<setting>``: each shaping receives the settings its config class declares).
SETTING_SLOTS: dict[str, Slot] = {**SLOTS, "reward_shaping": Slot("reward_shaping", "reward_shaping")}
# The sample filter --filter-groups uses when --sample-filter names none (a default, like --engine's).
DEFAULT_SAMPLE_FILTER = "dynamic"
# --algo-config KEY=VALUE looks KEY up in these slots' components (exactly one must have it).
ALGO_CONFIG_SLOTS = ("policy_loss", "advantage", "kl_estimator", "loss_agg", "model_adapter")


# --colocate's values; policy_ref and critic_reward combine, none and all stand alone.
COLOCATE_CHOICES = ("none", "policy_ref", "critic_reward", "all")
COLOCATE_PAIRS = ("policy_ref", "critic_reward")


def colocation(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``--colocate``'s values (one name, several, or names separated by commas, as a config file
    may hold them) in canonical form: ``()`` for none, ``("all",)``, or the pairs colocated, in
    `COLOCATE_PAIRS` order. Raises ConfigError for an unknown value or a combination with none/all."""
    items = [value] if isinstance(value, str) else list(value or ())
    names = [part.strip().lower().replace("-", "_") for item in items for part in str(item).split(",")]
    names = list(dict.fromkeys(name for name in names if name))
    unknown = [name for name in names if name not in COLOCATE_CHOICES]
    if unknown:
        raise ConfigError(f"--colocate {unknown[0]!r} is not one of {', '.join(COLOCATE_CHOICES)}")
    alone = [name for name in ("none", "all") if name in names]
    if alone and len(names) > 1:
        meaning = "colocates nothing" if alone[0] == "none" else "already puts every role in the policy actors"
        raise ConfigError(f"--colocate {alone[0]} {meaning}, so it cannot be combined with "
                          f"{', '.join(n for n in names if n != alone[0])}: give it alone, or only "
                          "policy_ref and/or critic_reward (--colocate policy_ref --colocate critic_reward)")
    if names == ["all"]:
        return ("all",)
    return tuple(pair for pair in COLOCATE_PAIRS if pair in names)


@dataclass(kw_only=True)
class TrainConfig(ModelOptions, DataOptions, OptimOptions, RuntimeOptions, OutputOptions, EvalOptions, ConfigBase):
    SLOTS: ClassVar[dict[str, Slot]] = SLOTS
    SETTING_SLOTS: ClassVar[dict[str, Slot]] = SETTING_SLOTS
    NESTED: ClassVar[dict[str, tuple[str, type]]] = NESTED

    # --- model ------------------------------------------------------------------------------
    critic_model: str | None = _opt(None, "Critic initialisation: a reward model (its score head becomes the value "
                                    "head) or any model, a local directory or a hub name (default: the policy "
                                    "model)", "model")
    teacher: str | None = _opt(None, "Teacher model for on-policy distillation (a local HF directory or a hub name "
                               "with the policy's tokenizer): each sampled token's advantage gains −λ·(log π − log "
                               "π_teacher) (--algo opd needs one; any RL run may add one)", "model")
    save_critic: bool = _opt(False, "Write the trained critic to <out>/critic at the end (algorithms with a critic)",
                             "model")

    # --- data -------------------------------------------------------------------------------
    input_key: str = _opt("prompt", "Dataset column holding the prompt (a string or chat messages)", "data")
    label_key: str | None = _opt(None, "Dataset column passed to rewards as the label", "data")
    allow_missing_labels: bool = _opt(False, "Train on rows whose --label-key value is missing (rewards get "
                                      "label None); without it such rows stop the run before it starts", "data")
    max_prompt_length: int = _opt(1024, "Prompt tokens kept (longer prompts lose their start, with a warning)", "data")

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
    kl_unbiased_gradient: bool = _opt(False, "KL in the loss: keep the estimator's value but use the importance-"
                                      "weighted reverse-KL gradient w·δ·∇logprobs, w = min(π/π_old, 10)",
                                      "algorithm")
    kl_target: float | None = _opt(None, "Adaptive KL (Ziegler et al.): steer β so the measured KL approaches this "
                                   "target (default: β stays --kl-coef)", "algorithm")
    teacher_coef: float | None = _opt(None, "λ, the weight of the teacher's per-token advantage −λ·(log π − log "
                                      "π_teacher) beside the task rewards' (default 1; needs --teacher)", "algorithm")
    kl_horizon: int = _opt(10000, "Adaptive KL: samples over which β may change by the clipped error ±20%",
                           "algorithm")

    # --- rollout ----------------------------------------------------------------------------
    engine: str = _opt("hf", "Rollout engine plugin (its options: --engine.NAME)", "rollout", component="rollout_engine")
    verify_weight_sync: bool = _opt(True, "After every weight sync to an engine with weights of its own (vllm, Ray "
                                    "rollout actors), check exact checksums of what it holds against what was sent "
                                    "and stop at a mismatch (docs/vllm.md)", "rollout")
    weight_sync_timeout_s: float = _opt(600.0, "Seconds one weight sync may take before the run stops with an error "
                                        "instead of hanging (0: no limit)", "rollout")
    prompts_per_step: int = _opt(8, "Prompts sampled per training step", "rollout")
    n_samples: int = _opt(8, "Completions per prompt (n, the group size)", "rollout")
    max_new_tokens: int = _opt(256, "Generation budget per completion, in tokens", "rollout")
    temperature: float = _opt(1.0, "Sampling temperature (log-probs are computed at the same temperature)", "rollout")
    top_p: float = _opt(1.0, "Nucleus sampling threshold (1: off)", "rollout")
    top_k: int = _opt(0, "Sample among the k most likely tokens only (0: off; log-probs: docs/algorithms.md)",
                      "rollout")
    repetition_penalty: float = _opt(1.0, "Penalty on tokens the sequence holds already, as in transformers (1: "
                                     "off; log-probs: docs/algorithms.md)", "rollout")
    env: str = _opt("single_turn", "Environment for each trajectory: a registered name or module:Class "
                    "(a label with an env_func key picks one per sample)", "rollout", component="env")
    agent: str | None = _opt(None, "Train an agent that speaks the OpenAI API: a registered name, file.py:fn or "
                             "module:fn, called once per trajectory with the dataset row and an endpoint of its own "
                             "(docs/agents.md; its options: --agent.NAME, e.g. --agent.timeout-s)", "rollout",
                             component="agent")
    tool_parser: str = _opt("hermes", "How the agent endpoint reads tool calls out of a completion (a registered "
                            "tool parser or module:fn)", "rollout", component="tool_parser")
    env_config: list[str] = _many("KEY=VALUE for an option of the environment, like --env.KEY (repeatable)",
                                  "rollout")
    engine_config: list[str] = _many("KEY=VALUE for an option of the rollout engine, like --engine.KEY, e.g. "
                                     "gpu_memory_utilization=0.4 for --engine vllm (repeatable)", "rollout")
    max_turns: int = _opt(8, "Model turns per trajectory at most (multi-turn environments)", "rollout")
    max_total_tokens: int | None = _opt(None, "Token budget per trajectory: prompt + turns + observations "
                                        "(default: --max-prompt-length + --max-turns x --max-new-tokens)", "rollout")
    async_rollout: bool = _opt(False, "Asynchronous RL: generate the next batches while the current one trains "
                               "(docs/async.md; one process locally, or rollout actors with --runtime ray)", "rollout",
                               flag="--async")
    max_staleness: int = _opt(1, "With --async: the batch of step s is generated by the policy of step s - K "
                              "(0: exactly the synchronous run)", "rollout")
    partial_rollouts: bool = _opt(False, "With --async: a trajectory still generating when a newer policy version "
                                  "is due goes on with the newer weights from its next token (docs/async.md; needs "
                                  "an engine that batches continuously)", "rollout")
    partial_chunk_tokens: int = _opt(8, "With --partial-rollouts: a trajectory's policy tokens per version step "
                                     "(the logical clock: token n of batch s comes from version "
                                     "s - K + n // this, at most s - 1)", "rollout")
    env_timeout_s: float | None = _opt(None, "Seconds one environment reset or step may take; past it the trajectory "
                                       "ends with the outcome tool_timeout (default: no limit)", "rollout")

    # --- failures (docs/outcomes.md) --------------------------------------------------------
    on_failure: str = _opt("retry", "What a failed trajectory (env_error, reward_error, tool_timeout, ...) gets: "
                           "retry (sample it again with a fresh environment and a seed of its own, at most "
                           "--max-retries times, then drop-group), drop-group (its prompt group leaves the batch) "
                           "or mask (the group trains; the failed samples leave the loss and the baseline)",
                           "failures", choices=("retry", "drop-group", "mask"))
    max_retries: int = _opt(2, "Attempts after the first for a failed trajectory under --on-failure retry", "failures")

    # --- sample filter ----------------------------------------------------------------------
    filter_groups: bool = _opt(False, "Dynamic filtering (DAPO): drop prompt groups whose rewards do not vary (or "
                               "whose mean score is outside --filter-range) and sample new prompts until "
                               "--prompts-per-step groups are kept", "filter")
    sample_filter: str | None = _opt(None, "The filter --filter-groups uses: a registered name or module:attr "
                                     "(default: dynamic; its options: --sample-filter.NAME)", "filter",
                                     component="sample_filter")
    max_filter_rounds: int = _opt(3, "Sampling rounds per step at most; then train on the groups kept so far, "
                                  "with a warning", "filter")

    # --- rewards ----------------------------------------------------------------------------
    reward: list[str] = _many("Reward source SPEC[@WEIGHT]: a registered name, file.py[:func], module:attr, "
                              "an http(s):// URL, a reward model directory or a reward model's hub name org/name "
                              "(repeatable)", "reward")
    reward_options: RewardOptions = field(default_factory=RewardOptions, metadata={
        "help": "How reward sources run, time out, retry and fail (flags --reward-<field>)", "group": "reward"})
    reward_shaping: list[str] = _many("Reward-shaping plugin applied after the reward sources (repeatable; its "
                                      "options: --reward-shaping.NAME). A shaping registered with enabled_by "
                                      "applies when that option is given, e.g. --overlong-buffer", "reward")
    max_failed_reward_steps: int = _opt(3, "Stop after this many steps in a row where a reward source failed on every "
                                        "sample (scored 0, or failed, under --reward-on-error zero/fail/skip)", "reward")

    # --- optimisation -----------------------------------------------------------------------
    steps: int | None = _opt(None, "Training steps (default: one pass over the data)", "train")
    ppo_epochs: int = _opt(1, "Passes over each rollout batch", "train")
    train_batch_size: int | None = _opt(None, "Samples per optimizer step (default: the whole rollout batch)", "train")
    lr: float = _opt(1e-6, "Policy learning rate", "train")
    critic_lr: float = _opt(9e-6, "Critic learning rate", "train")
    freeze_actor_steps: int = _opt(0, "Critic warm-up: train only the critic for the first N steps", "train")

    # --- eval -------------------------------------------------------------------------------
    eval_n_samples: int = _opt(1, "Completions per eval prompt (k of eval/pass@k)", "eval")
    eval_temperature: float | None = _opt(None, "Sampling temperature for eval (default: --temperature)", "eval")
    eval_max_samples: int | None = _opt(None, "Eval prompts at most (the first N of --eval-data)", "eval")

    # --- runtime ----------------------------------------------------------------------------
    runtime: str = _opt("local", "local: every worker in this process (or one data-parallel rank per process "
                        "under torchrun); ray: worker groups as Ray actors", "runtime", choices=("local", "ray"))

    offload_train_state: bool = _opt(False, "Move the policy's and critic's training state (optimizer states, "
                                     "gradients; the parameters too under ZeRO-3 when the engine has its own "
                                     "weights) off the device while the engine generates, and back exactly "
                                     "afterwards (the local runtime, or --runtime ray with --colocate all)", "runtime")
    offload_ref_reward: bool = _opt(False, "Keep the reference model and reward models off the device except while "
                                    "they score (moved back exactly for each use)", "runtime")

    # --- ray (--runtime ray) ----------------------------------------------------------------
    ray_address: str | None = _opt(None, "Join this Ray cluster (host:6379, ray://host:10001 or auto; implies "
                                   "--runtime ray) and ship the current directory to its workers; default: RAY_ADDRESS "
                                   "when set, else start a local cluster for the run", "ray")
    colocate: list[str] = _many("Roles that share one actor process (and its device) per rank: none (the default), "
                                "policy_ref, critic_reward, all (every role in the policy actors); repeat it for "
                                "both pairs: --colocate policy_ref --colocate critic_reward", "ray",
                                choices=COLOCATE_CHOICES)
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
    weight_sync: str = _opt("object-store", "How rollout actors with their own copy of the policy get its weights after "
                            "each step: object-store (policy rank 0's copy through Ray's object store) or broadcast "
                            "(policy rank 0 broadcasts over a torch.distributed group of its own with the rollout "
                            "actors: nccl on GPUs, gloo on CPUs)", "ray", choices=("object-store", "broadcast"))
    ray_env: list[str] = _many("KEY=VALUE environment variable for every Ray worker (repeatable; RLHF_LOAD_PLUGINS "
                               "and RLHF_DISABLE_PLUGINS are passed on from this process)", "ray")
    ray_place: list[str] = _many("ROLE=RESOURCE: put the actors holding ROLE (policy, reference, critic, rollout, "
                                 "reward) on the nodes that have this Ray resource (ray start --resources "
                                 "'{\"trainer\": 1}', or node:IP) (repeatable)", "ray")
    ray_exclude: list[str] = _many("PATTERN (gitignore syntax) left out of the directory --ray-address ships, on top "
                                   "of .gitignore/.rayignore, .git, venvs and runs (repeatable)", "ray")

    # --- output -----------------------------------------------------------------------------
    log_samples: int | None = _opt(None, "Samples per step written to samples.jsonl (default: all)", "output")
    log_tokens: int = _opt(4, "Samples per step (the first ones of samples.jsonl) whose tokens tokens.jsonl records "
                           "for rlhf view: ids, text, log-probs, advantage, KL, mask, origin, version (0: none)",
                           "output")

    def derived(self) -> Derived:
        """Values computed from the fields (validated here, once)."""
        if not self.model:
            raise ConfigError("--model is required")
        if not self.data:
            raise ConfigError("--data is required (a prompt dataset)")
        self.check_loggers()
        self.check_saving()
        self.check_eval_every()
        self.check_data_probs()
        for name, value in (("--prompts-per-step", self.prompts_per_step), ("--n-samples", self.n_samples),
                            ("--micro-batch-size", self.micro_batch_size)):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1; got {value}")
        self.check_ring()
        if self.ring_attn_size > 1 and self.async_rollout:
            raise ConfigError("--ring-attn-size does not work with --async yet; drop one of them")
        if self.ring_attn_size > 1 and self.runtime != "local":
            raise ConfigError("--ring-attn-size runs with the local runtime under torchrun, not with --runtime "
                              f"{self.runtime} yet")
        for name, value in (("--steps", self.steps), ("--max-new-tokens", self.max_new_tokens),
                            ("--ppo-epochs", self.ppo_epochs)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1; got {value}")
        for name, value in (("--lr", self.lr), ("--critic-lr", self.critic_lr)):
            if not value > 0:
                raise ConfigError(f"{name} must be positive; got {value}")
        self.check_prompt_format()
        if not self.temperature > 0:  # training log-probs are log softmax(z / τ): τ = 0 is no distribution
            raise ConfigError(f"--temperature must be positive (training samples from the policy and scores its "
                              f"tokens at that temperature); got {self.temperature}. For greedy eval use "
                              f"--eval-temperature 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] (1: off); got {self.top_p}")
        check_sampling(self.top_k, self.repetition_penalty)
        if self.eval_temperature is not None and self.eval_temperature < 0:
            raise ConfigError(f"--eval-temperature must be at least 0 (0: greedy); got {self.eval_temperature}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ConfigError(f"--max-tokens-per-micro-batch must be at least 1; got {self.max_tokens_per_micro_batch}")
        rollout = self.prompts_per_step * self.n_samples
        train_batch = self.train_batch_size or rollout
        if rollout % train_batch:
            raise ConfigError(f"--train-batch-size {train_batch} must divide the rollout batch "
                            f"(--prompts-per-step x --n-samples = {rollout})")
        for name, value, least in (("--eval-n-samples", self.eval_n_samples, 1),
                                   ("--max-staleness", self.max_staleness, 0),
                                   ("--partial-chunk-tokens", self.partial_chunk_tokens, 1),
                                   ("--max-filter-rounds", self.max_filter_rounds, 1),
                                   ("--freeze-actor-steps", self.freeze_actor_steps, 0),
                                   ("--max-retries", self.max_retries, 0)):
            if value < least:
                raise ConfigError(f"{name} must be at least {least}; got {value}")
        if self.partial_rollouts and not self.async_rollout:
            raise ConfigError("--partial-rollouts changes how --async generates: add --async --max-staleness K")
        if self.env_timeout_s is not None and not self.env_timeout_s > 0:
            raise ConfigError(f"--env-timeout-s must be positive (or left out for no limit); got {self.env_timeout_s}")
        if self.reward_options.on_error == "skip" and self.on_failure != "retry" and self.on_failure != "mask":
            raise ConfigError(f"--reward-on-error skip means --on-failure mask; with --on-failure {self.on_failure} "
                              "pass --reward-on-error fail")
        if self.save_best and not self.eval_data:
            raise ConfigError("--save-best needs --eval-data to score the policy on")
        best_metric(self.save_best)
        colocation(self.colocate)
        self.check_aux_loss_coef()
        if self.teacher_coef is not None and not self.teacher:
            raise ConfigError("--teacher-coef weighs a teacher's advantages, and no --teacher is given: add "
                              "--teacher MODEL or drop --teacher-coef")
        if self.teacher_coef is not None and not self.teacher_coef > 0:
            raise ConfigError(f"--teacher-coef must be positive; got {self.teacher_coef}")
        if self.kl_target is not None and not (self.kl_target > 0 and self.kl_horizon > 0):
            raise ConfigError(f"--kl-target and --kl-horizon must be positive; got {self.kl_target} and "
                              f"{self.kl_horizon}")
        return Derived(rollout_batch_size=rollout, train_batch_size=train_batch,
                       optimizer_steps_per_step=self.ppo_epochs * (rollout // train_batch), out_dir=self.out_dir)


@dataclass(frozen=True)
class Derived:
    rollout_batch_size: int  # samples generated per step
    train_batch_size: int  # samples per optimizer step
    optimizer_steps_per_step: int
    out_dir: Path


def ray_env_pairs(config: TrainConfig) -> list[tuple[str, str]]:
    """``--ray-env KEY=VALUE`` as ``(KEY, VALUE)`` pairs; a usage error for an item without ``=``."""
    pairs = []
    for item in config.ray_env:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--ray-env expects KEY=VALUE, got {item!r}")
        pairs.append((key.strip(), value))
    return pairs
