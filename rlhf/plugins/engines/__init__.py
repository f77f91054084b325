"""Built-in rollout engines: ``hf`` (transformers, in-process on the policy's weights) and ``vllm``
(vLLM in-process, weights pushed after each step), registered by `rlhf.plugins.engines.plugin`."""
