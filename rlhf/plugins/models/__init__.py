"""Built-in model adapters: ``hf`` (any AutoModelForCausalLM), with critic value heads."""
