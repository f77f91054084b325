"""rlhf-freeze: an example rlhf model-adapter plugin package."""
