"""Contract of an agent (``register_agents``), against an endpoint in front of a tiny random Llama:
called with a dataset row and its endpoint it talks to the policy through it (at least one request,
none refused) and returns a finite float, an ``AgentResult`` or None, within ``--agent.timeout-s``."""

from __future__ import annotations

import asyncio

from rlhf.plugin_kit.checks.target import Target, guarded

SAMPLE = {"prompt": "What is 12 + 7?", "answer": "19"}


def check(target: Target) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.core.protocols.agent import AgentConfig
    from rlhf.runtime.agents.calling import AgentCaller
    from rlhf.runtime.agents.endpoint import AgentEndpoint
    from rlhf.runtime.agents.requests import RunSampling

    ref = target.tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(ref)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    engine = _engine(target, model, tokenizer)
    parser = target.plugins.registry("tool_parser").component("hermes").load() if target.plugins else _plain
    config = target.config() if target.config_cls is not None else AgentConfig(timeout_s=300.0)
    endpoint = AgentEndpoint(engine, tokenizer, parser, RunSampling(temperature=1.0, top_p=1.0, top_k=0,
                                                                    repetition_penalty=1.0, max_new_tokens=8,
                                                                    max_total_tokens=256),
                             model_name="policy", continuous=True)
    try:
        trajectory, handle, record = endpoint.open(0, 0)
        caller = guarded(target, "reading its signature", lambda: AgentCaller(target.obj, config, target.name))
        called = asyncio.run(caller(dict(SAMPLE), handle))
        errors = endpoint.close(trajectory)
    finally:
        endpoint.stop()
    if called.outcome != "ok":
        raise target.fail(f"the call failed ({called.outcome}): {called.error}")
    if errors:
        raise target.fail(f"the endpoint refused its requests: {errors[0]}")
    if record.requests == 0:
        raise target.fail("sent no request to endpoint.base_url: a trajectory holds only what the policy sampled "
                          "through it, so nothing would train")
    reward = called.result.reward
    return [f"{'async' if caller.is_async else 'sync'} call with a dataset row and its endpoint",
            f"{record.requests} request(s) through the endpoint, none refused",
            f"returned {'no reward (--reward scores it)' if reward is None else f'the reward {reward:g}'}"]


def _engine(target: Target, model, tokenizer):
    """The built-in ``hf`` engine, reached through the registry as a run reaches it."""
    from rlhf.core.plugin_host.loading import build_plugin_manager

    plugins = target.plugins or build_plugin_manager()
    return plugins.registry("rollout_engine").component("hf").load()(model, tokenizer)


def _plain(text):
    from rlhf.core.protocols.tool_parser import ParsedTurn

    return ParsedTurn(content=text)
