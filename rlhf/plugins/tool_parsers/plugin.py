"""Built-in tool-call parsers: ``hermes`` (``<tool_call>{json}</tool_call>``, Qwen and Hermes models)."""

from __future__ import annotations

from rlhf.api import hookimpl


@hookimpl
def register_tool_parsers(register):
    register("hermes", "rlhf.plugins.tool_parsers.hermes:parse",
             description="<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> blocks (Hermes, Qwen)")
