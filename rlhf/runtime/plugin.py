"""Built-in runtime components as a plugin: the ``hf`` rollout engine, the ``torch`` training
backend and the loggers. Heavy objects are registered by reference (imported on first use)."""

import rlhf


@rlhf.hookimpl
def register_rollout_engines(register):
    register("hf", "rlhf.runtime.engines.hf:HFEngine", config_cls="rlhf.runtime.engines.hf:HFEngineConfig",
             description="transformers generate with a KV cache, in-process on the policy's own weights")
    register("vllm", "rlhf.runtime.engines.vllm_engine:VLLMEngine", needs_gpu=True,
             config_cls="rlhf.runtime.engines.vllm_engine:VLLMEngineConfig",
             description="vLLM in-process (extra: rlhf-core[vllm], CUDA); policy weights pushed after each step")


@rlhf.hookimpl
def register_train_backends(register):
    register("torch", "rlhf.runtime.backends.torch_backend:TorchBackend",
             config_cls="rlhf.runtime.backends.torch_backend:BackendConfig",
             description="AdamW, gradient accumulation, norm clipping, warmup + constant/cosine LR")
    register("deepspeed", "rlhf.runtime.backends.deepspeed_backend:DeepSpeedBackend",
             config_cls="rlhf.runtime.backends.deepspeed_backend:DeepSpeedConfig",
             description="DeepSpeed ZeRO stages 0-3 with CPU optimizer/parameter offload, the torch backend's math")
