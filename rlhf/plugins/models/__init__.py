"""Built-in model adapters: ``hf`` (any AutoModelForCausalLM, LoRA/QLoRA through peft when asked) and
``lora`` (the same with LoRA always on), with critic value heads."""
