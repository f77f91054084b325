"""Settings of the built-in rollout engines (no torch here: the command line reads them).

Fields declared with ``run_field`` are filled by the run (``rlhf.core.plugin_host.settings``); the others are
settings, ``--engine.<name>`` or ``--engine-config KEY=VALUE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.api import run_field

DECODERS = ("auto", "lean", "direct", "generate")


@dataclass(kw_only=True)
class HFEngineConfig:
    generation_batch_size: int | None = field(
        default=None, metadata={"help": "Prompts per generate call (None: all at once)", "range": "[1, inf)"})
    decoder: str = field(default="auto", metadata={
        "help": "auto (lean, else direct, when the model and the request allow it), lean (direct with the lean "
                "step of Llama-architecture models), direct (a loop over the model's forward), or generate "
                "(model.generate)"})
    continuous: bool = field(default=True, metadata={
        "help": "Multi-turn rollouts: each trajectory's turns join and leave one running decode batch, so a "
                "turn starts as soon as its tool call returns (false: one batched generate per turn)"})
    pack_head: bool = field(default=False, metadata={
        "help": "The lean step's output layer on a CPU: its weight laid out once per decode for the matrix product "
                "where that pays (a large vocabulary, many steps; same logits), instead of at every step. Costs a "
                "copy of that weight while decoding"})
    block_head: bool = field(default=True, metadata={
        "help": "The lean step's output layer on a CPU computed as W·hᵀ a block of the vocabulary at a time where "
                "that pays (16-128 rows, a large vocabulary; the same logits, no copy of the weight)"})
    synced_gpus: bool = run_field("synced_generation", False, "Ranks decode in lockstep until every rank has "
                                  "finished (the policy's weights are sharded over ranks: each forward is a collective)")


@dataclass(kw_only=True)
class VLLMEngineConfig:
    vllm_model_path: str | None = field(default=None, metadata={
        "help": "Checkpoint directory vLLM starts from (default: the one the policy was loaded from); the "
                "policy's weights are pushed over it before the first generation"})
    tokenizer: str | None = run_field("tokenizer", None, "Tokenizer directory for vLLM's detokenizer (stop strings)")
    dtype: str = run_field("dtype", "auto", "Weights dtype in vLLM: auto (the policy's parameter dtype), bf16, fp16, fp32")
    trust_remote_code: bool = run_field("trust_remote_code", False, "Allow model code from the checkpoint")
    seed: int = run_field("seed", 42, "vLLM's random seed")
    tensor_parallel_size: int = field(default=1, metadata={
        "range": "[1, inf)", "help": "GPUs vLLM shards the model over (> 1 is unverified: weights then travel pickled)"})
    gpu_memory_utilization: float = field(default=0.5, metadata={
        "range": "(0, 1]", "help": "Fraction of the GPU's memory vLLM takes for weights and KV cache; the training process "
                "must fit in the rest"})
    max_model_len: int | None = field(default=None, metadata={
        "range": "[1, inf)", "help": "Longest prompt + completion in tokens (default: the run's token budget, --max-total-tokens "
                "or --max-prompt-length + --max-turns x --max-new-tokens)"})
    max_total_tokens: int | None = run_field("max_total_tokens", None, "The run's token budget per trajectory")
    max_prompt_length: int = run_field("max_prompt_length", 1024, "The run's --max-prompt-length")
    max_new_tokens: int = run_field("max_new_tokens", 256, "The run's --max-new-tokens")
    max_turns: int = run_field("max_turns", 8, "The run's --max-turns")
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "Share the KV cache of common prompt prefixes (the n samples of a prompt)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "No CUDA graphs: slower decoding, faster start, less memory"})
    enable_sleep_mode: bool = field(default=False, metadata={
        "help": "Build vLLM with sleep mode, so sleep()/wake_up() can free its GPU memory between generations"})
    sleep_level: int = field(default=1, metadata={
        "range": "[1, 2]", "help": "1: weights to CPU memory and KV cache dropped; 2: both dropped (the next sync reloads the "
                "weights, so no CPU copy is kept)"})
    auto_sleep: bool = field(default=False, metadata={
        "help": "Sleep after every generation and wake for the next sync or generation (needs enable_sleep_mode)"})
    verify_weight_sync: bool = run_field("verify_weight_sync", True, "Check after every sync that vLLM holds exactly "
                                         "what was sent (exact checksums; --verify-weight-sync)")
    weight_sync_timeout_s: float = run_field("weight_sync_timeout_s", 600.0, "Seconds one sync may take before it "
                                             "raises instead of hanging (--weight-sync-timeout-s; 0: no limit)")
    sync_bucket_mb: float = field(default=512.0, metadata={
        "range": "(0, inf)", "help": "Weight sync chunk size in MiB (bounds the extra memory of merged/gathered copies)"})
    continuous: bool = field(default=True, metadata={
        "help": "Multi-turn rollouts: each turn is a request of its own in vLLM's running batch, so a turn starts "
                "as soon as its tool call returns (false: one batched generate per turn). Unverified on a GPU"})
