"""The RL loop (``rlhf train``): the trainer's step, its batches (sync and ``--async``) and their
scoring, rollouts, experience, the workers of each role and the wrappers that hide a launcher's
ranks from the loop, events, the step's guards and metrics, and the in-process runtime that builds
the roles.
"""
