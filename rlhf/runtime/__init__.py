"""The runtime: the two training loops and what they share, in wings.

* ``rl/``: the RL loop (``rlhf train``): the trainer and its step, batch making (sync and
  ``--async``), rollouts, experience, the workers of each role, and the in-process runtime that
  builds them (torchrun included);
* ``fit/``: the fit loop (``rlhf sft``, ``dpo``, ... ``fit``);
* ``step/``: one training step, shared by both loops (micro-batches, the forward, the optimizer step);
* ``run/``: what every run shares: lifecycle, run directory, checkpoints, data, evaluation, exports;
* ``config/``: options, each loop's config and its plan (resolved and checked before any model loads);
* ``ray/``: the Ray runtime.
"""
