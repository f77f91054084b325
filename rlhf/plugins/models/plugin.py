"""Registers the built-in model adapters (imported lazily: this module stays torch-free) and the
``rlhf merge-lora`` command."""

from rlhf.api import hookimpl

ROLES = ("policy", "reference", "critic", "reward")
# Settings that also get a plain flag (--lora-rank besides --model-adapter.lora-rank).
SHORT_FLAGS = ("attn_implementation", "gradient_checkpointing", "chat_template", "lora_rank", "lora_alpha",
               "lora_dropout", "target_modules", "load_in_4bit", "merge_lora", "value_head_prefix", "cpu_linear",
               "vocab_chunks", "in_place_gradients")


@hookimpl
def register_models(register):
    register("hf", "rlhf.plugins.models.hf:HFModelAdapter", config_cls="rlhf.plugins.models.config:HFModelConfig",
             short_flags=SHORT_FLAGS, roles=ROLES, merge_setting="merge_lora",
             description="Any AutoModelForCausalLM directory or hub name (LoRA when --lora-rank > 0); "
                                      "critic and reward model = backbone + scalar head")
    register("lora", "rlhf.plugins.models.hf:LoRAModelAdapter", config_cls="rlhf.plugins.models.config:HFModelConfig",
             short_flags=SHORT_FLAGS, roles=ROLES, merge_setting="merge_lora",
             description="The hf adapter with peft LoRA always on (rank 8 unless --lora-rank); "
                                      "reference = the base weights with the adapter off")


@hookimpl
def register_commands(cli):
    from rlhf.plugins.models.commands import merge_lora_command

    cli.add_command(merge_lora_command)
