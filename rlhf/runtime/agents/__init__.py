"""Training agents that speak the OpenAI API (``--agent``, docs/agents.md): an OpenAI-compatible
endpoint per trajectory in front of the rollout engine (`endpoint`; the requests it takes:
`requests`; its streamed answers: `streaming`), the chat template as it uses it (`template`),
token-exact recording of every request (`recording`), calling the agent (`calling`) and the rollout
that turns its records into trajectories (`rollout`)."""
