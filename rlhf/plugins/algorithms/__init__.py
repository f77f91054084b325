"""Built-in algorithm math (docs/algorithms.md): advantage estimators, KL estimators, the PPO policy loss and
loss aggregations, registered by `rlhf.plugins.algorithms.plugin`. The objective that combines
them and the critic's clipped value loss are the host's (``rlhf.algorithms``).

Where to look: ``grpo.py`` (grpo, dr_grpo), ``rloo.py``, ``reinforce.py`` (reinforce_pp,
reinforce_pp_baseline), ``gae.py``; ``returns.py`` holds what they share (reward placement,
returns, GAE, whitening) and ``groups.py`` the group statistics. Importing this package is
cheap: the modules that use torch are imported only when a run asks for them.
"""
