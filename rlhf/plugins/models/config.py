"""Settings of the ``hf`` and ``lora`` model adapters (no torch here: the command line reads them).

``dtype``, ``device``, ``trust_remote_code`` and ``save_critic`` are the run's (``--dtype``, ...);
the others are settings, ``--model-adapter.<name>`` or their short aliases (``--lora-rank``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.api import run_field


@dataclass(kw_only=True)
class HFModelConfig:
    dtype: str = run_field("dtype", "auto", "auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32")
    device: str = run_field("device", "auto", "auto, cpu, cuda or cuda:N")
    trust_remote_code: bool = run_field("trust_remote_code", False, "Run model code shipped with the checkpoint")
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa, eager or flash_attention_2"})
    cpu_linear: str = field(default="auto", metadata={
        "help": "Linear layers on a CPU: auto (oneDNN where MKL runs below the CPU's width), onednn or torch"})
    vocab_chunks: bool = field(default=True, metadata={
        "help": "Log-probs from the hidden states, a tile of positions x vocabulary at a time, recomputed in the "
                "backward (no float32 logits of a whole micro-batch: memory at a large vocabulary)"})
    in_place_gradients: bool = field(default=True, metadata={
        "help": "The embedding's and the tiled output layer's weight gradients added into .grad as they are computed "
                "(no dense vocabulary x hidden temporaries: memory at a large vocabulary)"})
    cudnn_attention: bool = field(default=False, metadata={
        "help": "Let sdpa use cuDNN's attention on a CUDA GPU (off: it builds a plan for every new sequence length, "
                "up to 2 s each)"})
    chat_template: str | None = field(default=None, metadata={"help": "Jinja file replacing the chat template"})
    value_head_prefix: str = field(default="score", metadata={
        "help": "Name of the critic's value head (read from reward-model checkpoints, used when saving)"})
    lora_rank: int = field(default=0, metadata={"help": "LoRA rank r (0: train every weight)", "range": "[0, inf)"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA α: the update B·A is scaled by α / r",
                                                  "range": "(0, inf)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch's input", "range": "[0, 1)"})
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "Module names given adapters (default: every linear layer but the output head)"})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA: frozen weights in 4-bit NF4 (GPU)"})
    merge_lora: bool = field(default=False, metadata={"help": "Also save the merged model to <final>/merged"})
    save_critic: bool = run_field("save_critic", False, "The run saves the critic (<out>/critic)")
