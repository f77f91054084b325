"""Built-in environments: ``single_turn`` (the default) and ``tir`` (python tool calls).

Registered by reference so that listing plugins imports neither the sandbox nor asyncio.
"""

from __future__ import annotations

from rlhf.api import hookimpl


@hookimpl
def register_envs(register):
    register("single_turn", "rlhf.plugins.envs.single_turn:SingleTurnEnv", multi_turn=False, gives_rewards=False,
             description="One model turn; the reward comes from the reward sources")
    register("tir", "rlhf.plugins.envs.tir:TIREnv", config_cls="rlhf.plugins.envs.tir:TIRConfig", multi_turn=True,
             gives_rewards=False,
             description="Tool-integrated reasoning: ```python blocks run in a sandbox, output comes back")
