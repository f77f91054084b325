"""Built-in algorithm math (docs/algorithms.md), registered by `rlhf.plugins.algorithms.plugin`.

Where to look: every term of the policy loss (the ppo and gspo losses, the mismatch corrections,
the KL estimators, the loss aggregations) is in ``policy_losses.py``; the advantage estimators are
``grpo.py`` (grpo, dr_grpo), ``rloo.py``, ``reinforce.py`` (reinforce_pp, reinforce_pp_baseline)
and ``gae.py``, with what they share in ``returns.py`` (reward placement, returns, GAE, whitening)
and ``groups.py`` (the group statistics). The formula that combines the loss terms and the
critic's clipped value loss are the host's (``rlhf/algorithms/training_loss.py``). Importing this
package is cheap: the modules that use torch are imported only when a run asks for them.
"""
