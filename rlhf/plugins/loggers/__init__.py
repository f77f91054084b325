"""Built-in loggers (metrics.jsonl, samples.jsonl, TensorBoard, Weights & Biases), plugins on the
lifecycle hooks: `rlhf.plugins.loggers.plugin`."""
