"""The runtime: trainer loop, workers, rollout engines, training backends, checkpoints, logging."""
