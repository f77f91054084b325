"""The built-in rollout engines as a plugin. Both are registered by reference, so listing plugins
imports neither torch nor vLLM."""

from rlhf.api import hookimpl


@hookimpl
def register_rollout_engines(register):
    register("hf", "rlhf.plugins.engines.hf:HFEngine", config_cls="rlhf.plugins.engines.config:HFEngineConfig",
             short_flags=("generation_batch_size",), continuous_batching=True,
             description="transformers generate with a KV cache, in-process on the policy's own weights")
    register("vllm", "rlhf.plugins.engines.vllm_engine:VLLMEngine", needs_gpu=True, continuous_batching=True,
             config_cls="rlhf.plugins.engines.config:VLLMEngineConfig",
             description="vLLM in-process (extra: rlhf-core[vllm], CUDA); policy weights pushed after each step")
