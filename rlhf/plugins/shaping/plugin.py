"""Registers the built-in reward shapings through the public hook."""

from __future__ import annotations

from rlhf.api import hookimpl


@hookimpl
def register_reward_shapings(register):
    register("overlong", "rlhf.plugins.shaping.overlong:overlong_shaping",
             description="DAPO soft overlong penalty: -factor·excess/buffer past --max-new-tokens minus "
                         "--overlong-buffer",
             config_cls="rlhf.plugins.shaping.overlong:OverlongConfig",
             short_flags=("overlong_buffer", "overlong_penalty_factor"), enabled_by="overlong_buffer")
    register("truncation", "rlhf.plugins.shaping.truncation:truncation_shaping",
             description="stop-properly penalty: scale (0..1) or replace (< 0) the reward of a truncated completion",
             config_cls="rlhf.plugins.shaping.truncation:TruncationConfig",
             short_flags=("truncated_reward",), enabled_by="truncated_reward")
