"""The RL loop (``rlhf train``): the trainer's step, its batches (sync and ``--async``), rollouts,
experience, the workers of each role, the step's metrics, and the in-process runtime that builds the roles.
"""
