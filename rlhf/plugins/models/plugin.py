"""Registers the built-in model adapters (imported lazily: this module stays torch-free)."""

import rlhf


@rlhf.hookimpl
def register_models(register):
    register("hf", "rlhf.plugins.models.hf:HFModelAdapter", config_cls="rlhf.plugins.models.hf:HFModelConfig",
             description="Any AutoModelForCausalLM directory or hub name; critic = backbone + value head")
