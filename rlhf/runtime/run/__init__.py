"""What every run shares, whatever its loop: the run directory and its lock, the lifecycle around the
steps (resume, interrupts, checkpoints, ``final/``), data loading, evaluation, the best model,
exports with their model card and prompt format, progress, plots, and the process's threads and heap.
"""
