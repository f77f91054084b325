"""The built-in training backends as a plugin. Registered by reference: listing plugins imports
neither torch nor DeepSpeed."""

import rlhf


@rlhf.hookimpl
def register_train_backends(register):
    register("torch", "rlhf.plugins.backends.torch_backend:TorchBackend",
             config_cls="rlhf.plugins.backends.config:BackendConfig",
             description="AdamW, gradient accumulation, norm clipping, warmup + constant/cosine LR")
    register("deepspeed", "rlhf.plugins.backends.deepspeed_backend:DeepSpeedBackend",
             config_cls="rlhf.plugins.backends.config:DeepSpeedConfig",
             description="DeepSpeed ZeRO stages 0-3 with CPU optimizer/parameter offload, the torch backend's math")
