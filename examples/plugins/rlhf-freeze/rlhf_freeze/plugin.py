import rlhf


@rlhf.hookimpl
def register_models(register):
    # Strings, not classes: adapter.py imports torch, and this module is imported by every command.
    register("freeze_last", "rlhf_freeze.adapter:FreezeAdapter", config_cls="rlhf_freeze.adapter:FreezeConfig",
             roles=("policy", "reference", "critic"), description="hf, training only the last N layers")
