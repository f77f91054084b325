"""The built-in training backends as a plugin. Registered by reference: listing plugins imports
neither torch nor DeepSpeed."""

from rlhf.api import hookimpl

# Settings that also get a plain flag (--weight-decay besides --backend.weight-decay).
OPTIMIZER_FLAGS = ("weight_decay", "adam_betas", "max_grad_norm", "lr_scheduler", "warmup_ratio")


def _zero3(config) -> bool:
    """ZeRO-3 partitions the parameters over the ranks (the instances' ``shards_weights``)."""
    return config.zero_stage == 3


@hookimpl
def register_train_backends(register):
    register("torch", "rlhf.plugins.backends.torch_backend:TorchBackend",
             config_cls="rlhf.plugins.backends.config:BackendConfig", short_flags=OPTIMIZER_FLAGS, offloads_state=True,
             description="AdamW, gradient accumulation, norm clipping, warmup + constant/cosine LR")
    register("deepspeed", "rlhf.plugins.backends.deepspeed_backend:DeepSpeedBackend",
             config_cls="rlhf.plugins.backends.config:DeepSpeedConfig",
             short_flags=OPTIMIZER_FLAGS + ("zero_stage", "offload_optimizer", "offload_params"), offloads_state=True,
             sharding_setting="zero_stage", shards_weights=_zero3,
             description="DeepSpeed ZeRO stages 0-3 with CPU optimizer/parameter offload, the torch backend's math")
