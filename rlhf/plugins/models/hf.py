"""The ``hf`` model adapter: any ``AutoModelForCausalLM`` directory or hub name (docs/models.md).

Roles: ``policy`` (trainable), ``reference`` (frozen, eval mode), ``critic`` (a backbone with a
scalar value head, see `critic.py`), ``reward`` (the same, saved as a one-label sequence
classifier, see `reward.py`). Options, each one flag of ``rlhf train``:

* ``dtype``: ``auto`` (bfloat16 on a GPU, float32 on a CPU), ``bf16``/``fp16``/``fp32`` or the
  long torch names;
* ``attn_implementation``: ``sdpa`` (default), ``eager``, or ``flash_attention_2`` (needs the
  flash-attn package and a CUDA GPU; asking for it without them is a ConfigError);
* ``gradient_checkpointing``: activations recomputed in backward (non-reentrant, so it also
  works when only LoRA weights train);
* ``cpu_linear``: on a CPU, ``auto`` runs float32 linear layers through oneDNN where torch's
  default (MKL) uses half the vector width (`rlhf.fastpaths.cpu_linear`), ``onednn`` always, ``torch`` never;
* ``vocab_chunks`` (on): the policy's and reference's log-probs come from their hidden states, a few
  positions' logits at a time (`rlhf.fastpaths.vocab_chunks`); ``--no-vocab-chunks``: the full logits;
* ``in_place_gradients`` (on): the policy's embedding and tiled output layer add their weight gradients
  into ``.grad`` themselves in a backend's backward, with no (vocabulary x hidden) temporaries
  (`rlhf.fastpaths.in_place_gradients`); ``--no-in-place-gradients``: autograd adds them;
* ``cudnn_attention``: on a CUDA GPU, whether PyTorch's sdpa may pick cuDNN's attention kernels
  (off by default: cuDNN builds an execution plan for every new sequence length, which rollouts,
  varying batch lengths and ``--packing`` meet on most calls; sdpa then takes its flash or
  memory-efficient kernels, which need no plan);
* ``trust_remote_code``: opt-in to model code shipped with a checkpoint;
* the tokenizer gets a pad token when it has none (EOS, else UNK), and ``chat_template`` (a Jinja
  file) replaces its chat template before any prompt is formatted;
* ``lora_rank > 0`` turns on LoRA/QLoRA (`lora.py`): the policy and critic train low-rank
  adapters and the reference is the policy with its adapter switched off, not a second copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch

from rlhf.api import (ConfigError, ModelAdapterBase, check_cpu_linear_mode, use_in_place_gradients, use_onednn_linears,
                      use_vocab_chunks)
from rlhf.plugins.models.config import HFModelConfig
from rlhf.plugins.models.critic import CriticModel
from rlhf.plugins.models.loading import (ATTENTION, DTYPES, check_attention, enable_activation_checkpointing,
                                         is_installed, loading_errors, quiet_transformers, read_chat_template,
                                         resolve_device, resolve_dtype, set_pad_token)
from rlhf.plugins.models.lora import DEFAULT_RANK, LoRA, check_qlora
from rlhf.plugins.models.reward import RewardModel

__all__ = ["ATTENTION", "DTYPES", "HFModelAdapter", "HFModelConfig", "LoRAModelAdapter", "check_attention",
           "enable_activation_checkpointing", "is_installed", "quiet_transformers", "read_chat_template",
           "resolve_device", "resolve_dtype", "set_pad_token"]
ROLES = ("policy", "reference", "critic", "reward")


class HFModelAdapter(ModelAdapterBase):
    """Loads policy, reference and critic models with transformers' Auto classes (LoRA when lora_rank > 0).

    Building one checks the settings; what the machine must have for them (flash-attn, bitsandbytes,
    a GPU) is checked when the first model loads, so a process that only needs the tokenizer (the
    Ray driver) builds the adapter the actors use."""

    def __init__(self, config: HFModelConfig | None = None):
        self.config = config or HFModelConfig()
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        check_attention(self.config.attn_implementation, None)
        check_cpu_linear_mode(self.config.cpu_linear)
        self.lora: Any = None
        if self.config.lora_rank > 0:
            self.lora = LoRA(self.config, self.device)
        elif self.config.load_in_4bit:
            raise ConfigError("--load-in-4bit freezes the weights in 4 bits, so only adapters can train: "
                              "add --lora-rank N (e.g. --lora-rank 16)")
        self._policy: tuple[str, torch.nn.Module] | None = None  # the reference (LoRA) reuses it

    # --- tokenizer ------------------------------------------------------------------------

    def load_tokenizer(self, ref: str) -> Any:
        from transformers import AutoTokenizer

        with loading_errors(ref, weights=False):
            tokenizer = AutoTokenizer.from_pretrained(ref, trust_remote_code=self.config.trust_remote_code)
        set_pad_token(tokenizer, ref)
        if self.config.chat_template:
            tokenizer.chat_template = read_chat_template(self.config.chat_template)
        return tokenizer

    # --- models ---------------------------------------------------------------------------

    def load(self, ref: str, *, role: str) -> torch.nn.Module:
        if role not in ROLES:
            raise ValueError(f"the hf adapter builds {', '.join(ROLES)} models, not {role!r}")
        check_attention(self.config.attn_implementation, self.device)
        if self.lora is not None and self.config.load_in_4bit:
            check_qlora(self.device)
        model = self._load(ref, role=role)
        if self.device.type == "cpu":
            use_onednn_linears(model, self.config.cpu_linear)
        if self.config.vocab_chunks and role in ("policy", "reference"):
            use_vocab_chunks(model)
        if self.config.in_place_gradients and role == "policy":
            use_in_place_gradients(model)
        if self.device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(self.config.cudnn_attention)  # process-wide, as the device is
        return model

    def _load(self, ref: str, *, role: str) -> torch.nn.Module:
        if role == "reference":
            if self.lora is not None and self._policy is not None and self._policy[0] == ref:
                return self.lora.reference_view(self._policy[1])  # the base weights, held once
            return self._from_pretrained("AutoModelForCausalLM", ref).eval().requires_grad_(False)
        if role in ("critic", "reward"):
            backbone = self._from_pretrained("AutoModel", ref, quiet=True)
            model_cls = CriticModel if role == "critic" else RewardModel
            critic = model_cls.from_backbone(backbone, ref, value_head_prefix=self.config.value_head_prefix,
                                             trust_remote_code=self.config.trust_remote_code)
            critic.backbone = self._trainable(critic.backbone, causal_lm=False)
            critic.head.to(device=self.device, dtype=self.dtype)  # the backbone is already placed
            return critic
        model = self._trainable(self._from_pretrained("AutoModelForCausalLM", ref), causal_lm=True)
        self._policy = (ref, model)
        return model

    def _from_pretrained(self, auto_class: str, ref: str, *, quiet: bool = False) -> torch.nn.Module:
        import transformers

        kwargs: dict[str, Any] = {"dtype": self.dtype, "trust_remote_code": self.config.trust_remote_code,
                                  "attn_implementation": self.config.attn_implementation}
        if self.lora is not None:
            kwargs.update(self.lora.quantization_kwargs(self.dtype))
        try:
            with loading_errors(ref), quiet_transformers() if quiet else contextlib.nullcontext():
                model = getattr(transformers, auto_class).from_pretrained(ref, **kwargs)
        except ValueError as exc:
            message = str(exc)
            if "trust_remote_code" in message:
                raise ConfigError(f"{ref} ships its own model code; pass --trust-remote-code to run it "
                                  "(only for checkpoints you trust)") from exc
            attention_words = ("attn_implementation", "scaled_dot_product_attention", "Flash Attention")
            if any(w in message for w in attention_words) and self.config.attn_implementation != "eager":
                raise ConfigError(f"{ref} cannot use --attn-implementation {self.config.attn_implementation}: "
                                  f"{message.splitlines()[0]} Try --attn-implementation eager") from exc
            raise
        return model if "quantization_config" in kwargs else model.to(self.device)

    def _trainable(self, model: torch.nn.Module, *, causal_lm: bool) -> torch.nn.Module:
        """Checkpointing first, then LoRA adapters (peft wraps the model, so the order matters)."""
        if self.lora is not None:
            return self.lora.wrap(model, causal_lm=causal_lm,
                                  gradient_checkpointing=self.config.gradient_checkpointing)
        if self.config.gradient_checkpointing:
            enable_activation_checkpointing(model)
        return model

    # --- outputs --------------------------------------------------------------------------

    def save(self, model: torch.nn.Module, tokenizer: Any, out_dir: Any) -> None:
        """The trained policy as an HF directory that ``from_pretrained`` (and vLLM) load.

        With LoRA: the PEFT adapter (``PeftModel.from_pretrained(base, out_dir)``), and the merged
        full model in ``out_dir/merged`` when ``merge_lora`` is set. A reward model (role
        ``reward``) is written whole, LoRA merged in, as a one-label sequence classifier.
        """
        if isinstance(model, RewardModel):
            model.save_pretrained(out_dir, pad_token_id=tokenizer.pad_token_id)
            tokenizer.save_pretrained(out_dir)
            return
        if self.lora is not None:
            self.lora.save(model, tokenizer, Path(out_dir), base=self._policy[0] if self._policy else None,
                           dtype=self.dtype)
            return
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    def save_critic(self, model: torch.nn.Module, tokenizer: Any, out_dir: Any) -> None:
        """The critic in OpenRLHF's layout (backbone + ``<value_head_prefix>.weight``), LoRA merged in."""
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)


class LoRAModelAdapter(HFModelAdapter):
    """The hf adapter with LoRA always on: rank ``--lora-rank``, or 8 when it is 0."""

    def __init__(self, config: HFModelConfig | None = None):
        config = config or HFModelConfig()
        super().__init__(dataclasses.replace(config, lora_rank=config.lora_rank or DEFAULT_RANK))
