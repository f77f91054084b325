"""LoRA (Hu et al., 2021, arXiv:2106.09685) and QLoRA (Dettmers et al., 2023, arXiv:2305.14314) via peft.

Each adapted linear layer computes ``W x + (α/r)·B A x`` with ``A (r, in)``, ``B (out, r)`` and B
initialised to zero, so training starts exactly at the base model and only A and B train. QLoRA
stores the frozen W in 4-bit NF4 (double quantisation, compute in the run's dtype).

The reference model is the policy module itself with its adapter switched off (peft's
``disable_adapter``), so the base weights are held once: `AdapterDisabledModel`. The critic's
backbone gets adapters of the same shape; its value head trains in full.

Outputs: the policy is saved as a PEFT adapter directory, plus a merged full model
(W + (α/r)·B A) when asked, made by `merge_lora` — the same code as ``rlhf merge-lora``, which
reloads the base model in full precision (for QLoRA this merges into the unquantised weights, as
peft's own merge recipe does).

Deviations: the reference view returns full-length logits (peft's forward does not declare
``logits_to_keep``); checkpoints hold the whole policy state (base weights included).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlhf.api import ConfigError, innermost, reading_weights
from rlhf.plugins.models.config import HFModelConfig
from rlhf.plugins.models.loading import enable_activation_checkpointing, is_installed, quiet_transformers

DEFAULT_RANK = 8


def target_modules(names: list[str] | str) -> str | list[str]:
    """``["q_proj,v_proj", "o_proj"]`` -> the list; nothing -> every linear layer but the output head."""
    items = [names] if isinstance(names, str) else names
    split = [n.strip() for item in items for n in item.split(",") if n.strip()]
    return split or "all-linear"


class LoRA:
    """LoRA settings of a run: wraps models in adapters, builds the reference view, saves adapters."""

    def __init__(self, config: HFModelConfig, device: torch.device):
        if config.lora_rank < 1 or config.lora_alpha <= 0 or not 0.0 <= config.lora_dropout < 1.0:
            raise ConfigError(f"LoRA needs --lora-rank >= 1, --lora-alpha > 0 and 0 <= --lora-dropout < 1; got "
                              f"{config.lora_rank}, {config.lora_alpha}, {config.lora_dropout}")
        if config.load_in_4bit:
            if config.save_critic:
                raise ConfigError("--save-critic with --load-in-4bit is not supported (the critic's backbone is "
                                  "4-bit); drop one of them")
        self.config, self.device = config, device

    def peft_config(self, *, causal_lm: bool) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.config.lora_rank, lora_alpha=self.config.lora_alpha,
                          lora_dropout=self.config.lora_dropout, bias="none",
                          target_modules=target_modules(self.config.target_modules),
                          task_type="CAUSAL_LM" if causal_lm else None)

    def quantization_kwargs(self, dtype: torch.dtype) -> dict[str, Any]:
        """``from_pretrained`` arguments that load the frozen weights in 4-bit NF4 (QLoRA); {} otherwise."""
        if not self.config.load_in_4bit:
            return {}
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=dtype)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return {"quantization_config": quantization, "device_map": {"": index}}

    def wrap(self, model: torch.nn.Module, *, causal_lm: bool, gradient_checkpointing: bool) -> torch.nn.Module:
        """``model`` with adapters on its target modules; only the adapters require gradients."""
        from peft import get_peft_model, prepare_model_for_kbit_training

        if self.config.load_in_4bit:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                    gradient_checkpointing_kwargs={"use_reentrant": False})
        elif gradient_checkpointing:
            enable_activation_checkpointing(model)
        try:
            with quiet_peft():
                return get_peft_model(model, self.peft_config(causal_lm=causal_lm))
        except ValueError as exc:  # e.g. a --target-modules name the model does not have
            raise ConfigError(f"LoRA could not adapt the model: {exc}") from exc

    def reference_view(self, policy: torch.nn.Module) -> AdapterDisabledModel:
        return AdapterDisabledModel(policy)

    def save(self, model: torch.nn.Module, tokenizer: Any, out_dir: Path, *, base: str | None,
             dtype: torch.dtype) -> None:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        absolute_base(out_dir / "adapter_config.json")
        if self.config.merge_lora:
            merge_lora(out_dir, out_dir / "merged", base=base, dtype=dtype,
                       trust_remote_code=self.config.trust_remote_code)


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft asks transformers ``is_gradient_checkpointing``, which transformers 5 deprecated: not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def check_qlora(device: torch.device) -> None:
    if not is_installed("bitsandbytes"):
        raise ConfigError("--load-in-4bit (QLoRA) needs the bitsandbytes package: pip install bitsandbytes; "
                          "or drop --load-in-4bit to train LoRA on full-precision weights")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"--load-in-4bit (QLoRA) needs a CUDA GPU; this run's device is {device}. "
                          "Drop --load-in-4bit to train LoRA on full-precision weights")


class AdapterDisabledModel(torch.nn.Module):
    """The base model behind a LoRA policy: the policy's own module run with its adapter switched off.

    A frozen causal LM to its callers: ``forward`` and ``generate`` run in eval mode without
    gradients and leave the policy's train/eval mode as they found it. The policy is a submodule
    (so ``parameters()`` reports the shared weights and their device), but ``train``,
    ``eval`` and ``requires_grad_`` on this view never reach it: the policy stays trainable.
    """

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        assert hasattr(policy, "disable_adapter"), "the reference view needs a peft model"
        self.policy = policy

    @property
    def config(self) -> Any:
        return self.policy.config

    @property
    def generation_config(self) -> Any:
        return self.policy.generation_config

    def get_output_embeddings(self) -> Any:
        """The policy's output layer (shared: with vocab chunks its log-probs come from hidden states too)."""
        return innermost(self.policy).get_output_embeddings()

    def train(self, mode: bool = True) -> AdapterDisabledModel:
        self.training = mode  # the view always runs the policy in eval mode
        return self

    def requires_grad_(self, requires_grad: bool = True) -> AdapterDisabledModel:
        return self  # never builds a graph; freezing here must not freeze the policy's adapters

    @contextlib.contextmanager
    def _base_weights(self) -> Iterator[None]:
        was_training = self.policy.training
        self.policy.eval()
        try:
            with torch.no_grad(), self.policy.disable_adapter():
                yield
        finally:
            self.policy.train(was_training)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        with self._base_weights():
            return self.policy(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._base_weights():
            return self.policy.generate(*args, **kwargs)


def absolute_base(config_file: Path) -> None:
    """peft records the base model as it was named (``./base``); a local one is recorded as an
    absolute path so the adapter loads (``rlhf merge-lora``, peft) from any directory."""
    values = json.loads(config_file.read_text())
    base = values.get("base_model_name_or_path")
    if base and Path(base).expanduser().is_dir() and not Path(base).is_absolute():
        values["base_model_name_or_path"] = str(Path(base).expanduser().resolve())
        config_file.write_text(json.dumps(values, indent=2, sort_keys=True))


def merge_lora(adapter_dir: str | Path, out_dir: str | Path, *, base: str | None = None,
               dtype: torch.dtype | str = "auto", trust_remote_code: bool = False) -> Path:
    """Write ``base`` with the adapter in ``adapter_dir`` merged in, as a plain HF model, to ``out_dir``.

    ``base`` defaults to the adapter's ``base_model_name_or_path``. The tokenizer comes from the
    adapter directory when it holds one (the run saves it there), else from the base; the run's
    prompt format and model card come along (`carry_run_files`).
    """
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ConfigError(f"{adapter_dir} is not a LoRA adapter directory (no adapter_config.json)")
    base = base or PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    if not base:
        raise ConfigError(f"{adapter_dir}/adapter_config.json names no base model; pass --base MODEL")
    if not Path(base).is_absolute() and base.startswith((".", "~")) and not Path(base).expanduser().is_dir():
        raise ConfigError(f"{adapter_dir}/adapter_config.json names its base model by the relative path {base!r}, "
                          f"which is not a directory from here ({Path.cwd()}); pass --base MODEL, or run from the "
                          "directory the training ran in")
    try:
        with reading_weights(base):
            model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise ConfigError(f"cannot load the base model {base!r} of {adapter_dir}: {exc}. Pass --base MODEL") from exc
    with quiet_transformers(), quiet_peft():
        merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    has_tokenizer = any((adapter_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    AutoTokenizer.from_pretrained(adapter_dir if has_tokenizer else base,
                                  trust_remote_code=trust_remote_code).save_pretrained(out_dir)
    carry_run_files(adapter_dir, out_dir, base)
    return out_dir


def carry_run_files(adapter_dir: Path, out_dir: Path, base: str) -> None:
    """What a run wrote beside the adapter goes with the merged model: the prompt format it was trained
    with (``prompt_format.json``: without it, commands would format prompts another way and the model
    answer badly) and its model card (README.md), whose note on loading an adapter no longer applies."""
    if (adapter_dir / "prompt_format.json").is_file():
        (out_dir / "prompt_format.json").write_bytes((adapter_dir / "prompt_format.json").read_bytes())
    card = adapter_dir / "README.md"
    if card.is_file() and not (out_dir / "README.md").is_file():
        kept = [line for line in card.read_text().splitlines() if not line.startswith("This directory is a ")]
        kept.append(f"\nThe LoRA adapter `{adapter_dir}` merged into `{base}` (`rlhf merge-lora`): a plain Hugging "
                    "Face model, loaded without peft.")
        (out_dir / "README.md").write_text("\n".join(kept).rstrip() + "\n")


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state with every LoRA update added in (W + (α/r)·B A); ``model`` is unchanged."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapter = model.active_adapter
    merged: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight
            if not weight.dtype.is_floating_point:
                raise ConfigError("merging LoRA into quantized weights is not supported; train without --load-in-4bit")
            merged[f"{name}.weight"] = weight.detach() + module.get_delta_weight(adapter).to(weight.dtype)
    for key, tensor in base.state_dict().items():
        if ".lora_" not in key:
            merged.setdefault(key.replace(".base_layer.", "."), tensor)
    return merged
