"""Built-in reward functions (``--reward exact_match``, ``regex_match``, ``think_format``,
``boxed_math``), registered by `rlhf.plugins.rewards.plugin` through the public hook.

The machinery that resolves a reward SPEC, calls functions by signature, talks to reward servers,
scores with reward models and combines sources is the host's: ``rlhf.rewards``.
"""
