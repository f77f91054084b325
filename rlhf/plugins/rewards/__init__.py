"""Reward sources (DESIGN §7): Python functions called by signature, remote HTTP servers speaking
OpenRLHF's protocol, reward models, their weighted combination and the failure policy.

The public entry point is ``rlhf.rewards`` (``load_reward``, ``load_rewards``). This package stays
light to import: torch and aiohttp are imported only when a source that needs them scores.
"""
