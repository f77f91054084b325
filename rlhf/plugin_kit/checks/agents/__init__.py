"""The contract checks of the agent kinds: agents and tool-call parsers (docs/agents.md)."""
