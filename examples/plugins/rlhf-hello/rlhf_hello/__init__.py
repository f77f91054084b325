"""rlhf-hello: an example rlhf plugin package."""
