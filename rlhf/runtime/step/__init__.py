"""One training step, shared by the RL loop and the fit loop: how a batch is cut into micro-batches,
the forward, the optimizer step of a trained model, and the metrics added up over micro-batches.
"""
