"""Built-in training backends: ``torch`` (AdamW in this process, gradients summed over ranks) and
``deepspeed`` (ZeRO 0-3 with offload), registered by `rlhf.plugins.backends.plugin`."""
