"""Options shared by every training command, defined once: ``rlhf train`` (`TrainConfig`) and
``rlhf fit`` / ``sft`` / ``rm`` / ... (`FitConfig`) are built from these groups.

Every field of a config becomes a flag of its command (``micro_batch_size`` -> ``--micro-batch-size``)
with the field's help text, and a key of ``--config run.yaml``. A component's own settings (its
``config_cls`` fields, ``rlhf.core.plugin_host.settings``) live in ``components``, keyed by the slot that
selects the component (a config class's ``SLOTS``): ``--backend.zero-stage 3`` is
``components["backend"]["zero_stage"] = 3``. A component registered with ``short_flags`` gives
those settings a plain flag too (``--zero-stage 3``, ``--lora-rank 16``), in flags and in config
files (`short_flag_slots`): built-ins and third-party plugins alike.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from rlhf.core.errors import ConfigError


@dataclass(frozen=True)
class Slot:
    """A place in a run that one component fills: the field naming it and the component's kind."""

    field: str  # the config field that selects the component, and the key in ``components``
    kind: str  # the component kind (rlhf.core.plugin_host.kinds)

    @property
    def flag(self) -> str:
        """The selecting flag, also the namespace of the component's own flags (``--backend.zero-stage``)."""
        return "--" + self.field.replace("_", "-")


MODEL_SLOTS = {slot.field: slot for slot in (Slot("model_adapter", "model"), Slot("backend", "train_backend"))}


def short_flag_slots(plugins: Any, slots: dict[str, Slot], reserved: Any = ()) -> dict[str, str]:
    """Setting -> slot for every ``short_flags`` name the registered components of ``slots``' kinds
    declare (``zero_stage`` -> ``backend``). A name that is one of the command's own options
    (``reserved``) stays namespaced only; one that a component of an earlier slot already took
    too, with a warning on the plugin that declared it (``rlhf plugins list`` shows it)."""
    reserved = set(reserved)
    out: dict[str, str] = {}
    for slot in slots.values():
        for component in plugins.registry(slot.kind).components():
            for name in component.short_flags:
                if name in reserved:  # the command has an option of that name: namespaced flag only
                    continue
                if out.setdefault(name, slot.field) == slot.field:
                    continue
                warning = (f"short flag --{name.replace('_', '-')} of {component.kind.title} {component.name!r} is "
                           f"a {slots[out[name]].flag} setting already; use {slot.flag}.{name.replace('_', '-')}")
                if warning not in component.provider.warnings:
                    component.provider.warnings.append(warning)
    return out


def opt(default: Any, help: str, group: str, **extra: Any) -> Any:
    """A config field: its default, its help text, and the help section (``group``) it is listed in."""
    return field(default=default, metadata={"help": help, "group": group, **extra})


def many(help: str, group: str, **extra: Any) -> Any:
    """A repeatable option (a list); ``choices=`` limits each value."""
    return field(default_factory=list, metadata={"help": help, "group": group, "multiple": True, **extra})


# --- the groups -----------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ModelOptions:
    model: str = opt("", "Model to train: a local HF directory or a hub name", "model", required=True)
    tokenizer: str | None = opt(None, "Tokenizer directory or hub name (default: the model's)", "model")
    model_adapter: str = opt("hf", "Model adapter plugin that builds the models (its options: "
                             "--model-adapter.NAME, e.g. --lora-rank)", "model", component="model")
    dtype: str = opt("auto", "Weights dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32", "model",
                     choices=("auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"))
    device: str = opt("auto", "Device for the local runtime: auto, cpu, cuda, cuda:N", "model")
    trust_remote_code: bool = opt(False, "Allow model code from the checkpoint (only for models you trust)", "model")


@dataclass(kw_only=True)
class DataOptions:
    data: list[str] = many("Dataset: .jsonl/.json/.parquet/.csv file, save_to_disk dir or hub name (repeatable)",
                           "data")
    data_split: str = opt("train", "Split to use from folders with several splits and from hub datasets", "data")
    data_probs: str | None = opt(None, "Mixing probabilities for several --data, e.g. 0.7,0.3", "data")
    apply_chat_template: bool = opt(False, "Format prompts with the tokenizer's chat template", "data")
    input_template: str | None = opt(None, "Template for string prompts, with {} for the prompt", "data")
    max_samples: int | None = opt(None, "Use at most this many rows from each dataset", "data")

    def check_prompt_format(self) -> None:
        """One way to format prompts: the chat template and an input template both would, and one
        of them would be dropped without a word."""
        if self.apply_chat_template and self.input_template is not None:
            raise ConfigError("--apply-chat-template and --input-template both format the prompt; give one (the "
                              "chat template wraps it in the model's turn markers, the input template in your text)")

    @property
    def mixing_probs(self) -> list[float] | None:
        """``--data-probs``: one probability per ``--data``, >= 0, adding up to 1 (within 1e-6; then
        rescaled to exactly 1, as the sampler wants)."""
        if not self.data_probs:
            return None
        try:
            probs = [float(p) for p in str(self.data_probs).split(",")]
        except ValueError:
            raise ConfigError(f"--data-probs expects numbers separated by commas, got {self.data_probs!r}") from None
        if len(probs) != len(self.data):
            raise ConfigError(f"--data-probs has {len(probs)} values for {len(self.data)} --data; give one per --data")
        if not all(math.isfinite(p) and p >= 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
            raise ConfigError(f"--data-probs must be numbers >= 0 that add up to 1; got {self.data_probs} "
                              f"(sum {sum(probs):g})")
        return [p / sum(probs) for p in probs]

    def check_data_probs(self) -> None:
        """``--data-probs`` refused before any data loads (`mixing_probs`)."""
        self.mixing_probs  # noqa: B018


@dataclass(kw_only=True)
class OptimOptions:
    micro_batch_size: int = opt(8, "Samples per forward/backward (gradient accumulation inside a step)", "train")
    max_tokens_per_micro_batch: int | None = opt(None, "Cut micro-batches by tokens instead of rows: at most this "
                                                 "many tokens each (padded rows x length; with --packing, real "
                                                 "tokens), a longer sequence alone", "train")
    packing: bool = opt(False, "Pack each micro-batch's sequences into one row without padding (attention "
                        "kept within each sequence) for the log-prob forwards", "train")
    share_prompt: bool = opt(True, "Run a prompt that several sequences share once, each sequence attending to it "
                             "under a mask (a DPO pair's chosen and rejected; in rlhf train a prompt's samples, when "
                             "that saves a tenth of the tokens): the same log-probs, fewer tokens. Needs sdpa or eager "
                             "attention; not with --max-tokens-per-micro-batch, nor in rlhf train with --packing "
                             "(a DPO pair's rows run packed and shared on Llama-architecture models)", "train")
    ring_attn_size: int = opt(1, "Sequence parallelism: split every sequence of the training forwards over N ranks "
                              "(ring attention). Under torchrun with a multiple of N processes; the data-parallel "
                              "degree becomes processes / N (docs/long-context.md)", "train")
    ring_head_stride: int = opt(1, "With --ring-attn-size: key/value heads gathered from the ring at a time (fewer: "
                                "less memory, more messages; must divide the model's key/value heads)", "train")
    backend: str = opt("torch", "Training backend plugin (its options: --backend.NAME, e.g. --zero-stage)", "train",
                       component="train_backend")
    max_nonfinite_steps: int = opt(3, "Stop after this many NaN/inf optimizer steps in a row (each is skipped)",
                                   "train")
    aux_loss_coef: float = opt(0.0, "Mixture-of-experts models (Mixtral, Qwen2-MoE, ...): add the router "
                               "load-balancing loss of the training forwards, times this, to the loss (0: off)",
                               "train")
    seed: int = opt(42, "Random seed (data order, sampling, initialisation)", "train")

    def check_ring(self) -> None:
        """``--ring-attn-size`` and ``--ring-head-stride``: whole numbers of at least 1."""
        for name, value in (("--ring-attn-size", self.ring_attn_size), ("--ring-head-stride", self.ring_head_stride)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number of at least 1; got {value}")

    def check_aux_loss_coef(self) -> None:
        if not (self.aux_loss_coef >= 0 and math.isfinite(self.aux_loss_coef)):
            raise ConfigError(f"--aux-loss-coef must be a finite number >= 0 (0: off); got {self.aux_loss_coef}")
        if self.aux_loss_coef and self.ring_attn_size > 1:
            raise ConfigError("--aux-loss-coef does not work with --ring-attn-size yet (each rank of the ring routes "
                              "a slice of every sequence, and the load-balancing loss needs the whole); drop one")


@dataclass(kw_only=True)
class RuntimeOptions:
    threads: int | Literal["auto"] | None = opt(
        None, "CPU threads for torch in each process: a number, or auto to follow the machine's load (faster on a "
        "busy machine, not bit-reproducible). Default: half the usable cores (OMP_NUM_THREADS where set), fixed, "
        "recorded in config.yaml and reused by --resume", "runtime")


@dataclass(kw_only=True)
class OutputOptions:
    out: str | None = opt(None, "Run directory (default: runs/<date>-<time>)", "output")
    save_every: int = opt(0, "Checkpoint every N steps (0 or -1, OpenRLHF's never: only at the end)", "output")
    keep_checkpoints: int = opt(2, "Checkpoints kept (oldest removed first); also the number of --save-hf-every "
                                "exports kept", "output")
    save_hf_every: int = opt(0, "Every N steps also write the trained model as final/ is written (Hugging Face "
                             "format, with its tokenizer) to checkpoints/step_N/hf, and with --save-critic the "
                             "critic to step_N/hf_critic (0 or -1: never); pruned with the checkpoints", "output")
    resume: bool = opt(False, "Continue from the latest complete checkpoint in --out, with the run's options",
                       "output")
    resume_override: list[str] = many("With --resume: an option to change from the checkpoint on, e.g. lr or steps, "
                                      "or plugins (other plugin versions) or data (data files changed since) "
                                      "(repeatable; other changed options that alter training are refused)", "output")
    tensorboard: bool = opt(False, "Also log metrics to TensorBoard (in <out>/tensorboard)", "output")
    wandb_project: str | None = opt(None, "Also log to this Weights & Biases project (pip install "
                                    "'rlhf-core[wandb]')", "output")
    wandb_group: str | None = opt(None, "W&B group of the run (runs compared together, e.g. the seeds of a sweep)",
                                  "output")
    wandb_run_name: str | None = opt(None, "W&B run name (default: the --out folder's name)", "output")
    progress: bool = opt(True, "Show a progress bar (a plain line per step when not a terminal)", "output")

    @property
    def out_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")

    def check_saving(self) -> None:
        """``-1`` is OpenRLHF's "never" (``--save_steps -1``): here the same as 0."""
        for name, value, meaning in (("--save-every", self.save_every, "only at the end"),
                                     ("--save-hf-every", self.save_hf_every, "never")):
            if value < -1:
                raise ConfigError(f"{name} must be a number of steps, or 0 or -1 ({meaning}); got {value}")

    def check_loggers(self) -> None:
        """The packages the chosen loggers need, before any model loads."""
        import importlib.util

        if (self.wandb_group or self.wandb_run_name) and not self.wandb_project:
            raise ConfigError("--wandb-group and --wandb-run-name name a W&B run: add --wandb-project")
        for wanted, package, extra in ((self.wandb_project, "wandb", "wandb"),
                                       (self.tensorboard, "tensorboard", "tensorboard")):
            if wanted and importlib.util.find_spec(package) is None:
                raise ConfigError(f"--{'wandb-project' if package == 'wandb' else 'tensorboard'} needs the {package} "
                                  f"package: pip install 'rlhf-core[{extra}]'")


@dataclass(kw_only=True)
class EvalOptions:
    eval_data: list[str] = many("Held-out dataset to evaluate on, read with the same data options as --data "
                                "(repeatable)", "eval")
    eval_every: int = opt(0, "Evaluate every N steps (0: rlhf train at the start and the end only; the fit commands "
                          "at the end of each epoch; -1, OpenRLHF's never: never in between, only at the end, and "
                          "rlhf train at the start)", "eval")

    def check_eval_every(self) -> None:
        if self.eval_every < -1:
            raise ConfigError(f"--eval-every must be a number of steps, 0 (the default schedule) or -1 (never in "
                              f"between); got {self.eval_every}")
    save_best: str | None = opt(None, "Keep the model that scored best on this eval metric in <out>/best, e.g. "
                                "eval/loss, eval/accuracy or eval/reward/mean (metrics named *loss are minimised, "
                                "others maximised; append :min or :max to say)", "eval")


def data_parallel_ranks(config: OptimOptions, ranks: int) -> str:
    """How error messages name the number of data-parallel ranks."""
    if config.ring_attn_size > 1:
        return f"the number of data-parallel ranks, processes / --ring-attn-size ({ranks})"
    return f"the number of processes ({ranks})"


def check_sampling(top_k: int, repetition_penalty: float) -> None:
    """The sampling options every sampling command shares beyond temperature and top-p."""
    if not isinstance(top_k, int) or top_k < 0:
        raise ConfigError(f"--top-k must be a whole number >= 0 (0: off); got {top_k}")
    if not repetition_penalty > 0:
        raise ConfigError(f"--repetition-penalty must be positive (1: off); got {repetition_penalty}")


def best_metric(spec: str | None) -> tuple[str, str] | None:
    """``"eval/accuracy"`` -> ``("eval/accuracy", "max")``; ``"eval/loss"`` -> ``("eval/loss", "min")``."""
    if not spec:
        return None
    name, _, direction = spec.partition(":")
    if not direction:
        direction = "min" if name.rsplit("/", 1)[-1].endswith("loss") else "max"
    if direction not in ("min", "max"):
        raise ConfigError(f"--save-best {spec}: the direction after ':' must be min or max")
    if not name.startswith("eval/"):
        name = "eval/" + name
    return name, direction


@dataclass(kw_only=True)
class ConfigBase:
    """What every run config has: component settings by slot, and (de)serialisation."""

    SLOTS: ClassVar[dict[str, Slot]] = MODEL_SLOTS  # the components a run picks, one per slot
    SETTING_SLOTS: ClassVar[dict[str, Slot] | None] = None  # namespaces of component settings (None: SLOTS)
    NESTED: ClassVar[dict[str, tuple[str, type]]] = {}  # field -> (flag prefix, dataclass): --reward-on-error

    components: dict[str, dict[str, Any]] = field(default_factory=dict, metadata={
        "help": "Settings of the chosen components, by slot: {backend: {zero_stage: 3}, ...} (flags "
                "--<slot>.<option>)", "group": "components"})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def short_flags(cls, plugins: Any) -> dict[str, str]:
        """Setting -> slot of the settings with a plain flag, from ``plugins``' registrations."""
        return short_flag_slots(plugins, cls.setting_slots(), reserved={f.name for f in dataclasses.fields(cls)})

    @classmethod
    def setting_slots(cls) -> dict[str, Slot]:
        return cls.SETTING_SLOTS if cls.SETTING_SLOTS is not None else cls.SLOTS

    def check_setting_ranges(self, plugins: Any) -> None:
        """Each ``--<slot>.<setting>`` value against the range its config class declares, refused with
        the plan's message (``the 'hf' model: --lora-rank must be at least 0; got -4``) before any
        component loads: config classes import no torch, components may. A slot whose component is
        chosen later (an algorithm's pieces come from its preset) is checked when every registered
        component of its kind that has the setting declares the same range (named in the message when
        only one has it); one given as ``module:attr`` is left to the plan, as is anything else wrong
        with a setting (an unknown name, a run field), which the plan says with the full picture."""
        from rlhf.core.plugin_host.references import is_reference
        from rlhf.core.plugin_host.settings import RANGE, check_range, coerce, setting_fields

        slots = self.setting_slots()
        for slot_name, settings in self.components.items():
            slot = slots.get(slot_name)
            if slot is None or not settings:
                continue
            registry = plugins.registry(slot.kind)
            chosen = getattr(self, slot.field, None)
            if isinstance(chosen, str) and is_reference(chosen):
                continue
            try:
                named = [registry.component(chosen)] if isinstance(chosen, str) and chosen else None
            except Exception:  # noqa: BLE001 - an unknown or conflicting name: the plan says it
                continue
            candidates = named if named is not None else registry.components()
            for name, value in settings.items():
                owners = []
                for component in candidates:
                    try:
                        config_cls = component.load_config_cls()
                    except Exception:  # noqa: BLE001 - a broken plugin: the plan says it
                        continue
                    field_ = next((f for f in setting_fields(config_cls) if f.name == name), None)
                    if field_ is not None:
                        owners.append((component, config_cls, field_))
                if not owners or len({f.metadata.get(RANGE) for _, _, f in owners}) != 1:
                    continue
                component, config_cls, field_ = owners[0]
                one = named is not None or len(owners) == 1  # the component the plan will name
                shown = (f"--{name.replace('_', '-')}" if one and name in component.short_flags
                         else f"{slot.flag}.{name.replace('_', '-')}")
                where = f"the {component.name!r} {slot.kind.replace('_', ' ')}: {shown}" if one else shown
                hint = typing.get_type_hints(config_cls)[name]
                try:
                    number = coerce(value, hint, f"{slot.flag}.{name.replace('_', '-')}")
                except ConfigError:  # the plan names the component in the same message
                    continue
                check_range(number, field_.metadata.get(RANGE), where)

    @classmethod
    def from_dict(cls, values: dict[str, Any], plugins: Any = None) -> Any:
        """From a mapping of field names. Nested groups may be mappings or prefixed flat keys;
        component settings may be ``components: {slot: {...}}``, dotted keys (``backend.zero_stage``)
        or the short flags the registered components declare (``zero_stage``; ``plugins``: the
        plugin set that declares them, by default the installed plugins)."""
        from rlhf.core.plugin_host.loading import installed_plugins

        values = unflatten(dict(values), cls.NESTED)
        short_flags = cls.short_flags(installed_plugins(plugins))
        values["components"] = gather_components(values, cls.setting_slots(), short_flags)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            from rlhf.core.errors import close_matches

            hint = close_matches(unknown[0], sorted(known), n=1)
            raise ConfigError(f"unknown config key(s): {', '.join(unknown)}"
                              + (f"; did you mean {hint[0]}?" if hint else ""))
        for name, (_, group_cls) in cls.NESTED.items():
            if isinstance(values.get(name), dict):
                values[name] = group_cls(**values[name])
        return cls(**values)


def gather_components(values: dict[str, Any], slots: dict[str, Slot],
                      aliases: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Pop every component setting out of ``values`` (aliases, dotted keys, the ``components``
    mapping) into ``{slot: {field: value}}``; the same setting given twice with two values is an error."""
    found: dict[str, dict[str, Any]] = {}

    def put(slot: str, name: str, value: Any, how: str) -> None:
        slot, name = slot.replace("-", "_"), name.replace("-", "_")
        if slot not in slots:
            raise ConfigError(f"{how}: no component slot {slot!r}; slots: {', '.join(slots)}")
        settings = found.setdefault(slot, {})
        if name in settings and settings[name] != value:
            raise ConfigError(f"{slots[slot].flag}.{name.replace('_', '-')} is given twice, as {settings[name]!r} "
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
    for key in [k for k in values if "." in k or k in aliases]:
        value = values.pop(key)
        slot, _, name = key.partition(".") if "." in key else (aliases[key], "", key)
        put(slot, name, value, key)
    return found


def unflatten(values: dict[str, Any], nested: dict[str, tuple[str, type]]) -> dict[str, Any]:
    """``{"reward_on_error": "skip"}`` -> ``{"reward_options": {"on_error": "skip"}}`` (other keys unchanged)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        for name, (prefix, group_cls) in nested.items():
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
    from rlhf.core.inputs.safe_yaml import load_yaml

    values = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        shown = item if len(item) <= 80 else item[:77] + "..."
        values[key.strip().replace("-", "_")] = load_yaml(raw, f"{flag} {shown}")
    return values
