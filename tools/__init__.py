"""Developer tools run from the repository root (``python tools/mutate.py``, ``python3 -m tools.gpu_kit``)."""
