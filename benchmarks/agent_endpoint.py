"""The agent endpoint's cost: 64 concurrent two-turn agent conversations through the OpenAI-compatible
endpoint (`rlhf.runtime.agents`; one shared aiohttp session, or ``--client openai``) against the same requests sent to the
engine's ``generate_one`` directly, alternating in one process; median wall and CPU seconds.

The endpoint run records what it asked the engine (prompt tokens and sampling parameters, seeds
included); the direct run replays exactly those requests, each conversation's second turn sent when
its first returns, so both decode the same tokens in the same continuous batch. Goal: the HTTP layer
costs at most 10%.

    python benchmarks/agent_endpoint.py --model tiny --conversations 64 --max-new-tokens 16 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import machine_line, median, model_dir, setup_environment, work_dir  # noqa: E402


class Recording:
    """The engine as the endpoint sees it: each conversation's requests in order (a request whose prompt
    starts with a conversation's first prompt belongs to it)."""

    def __init__(self, engine):
        self.engine, self.eos_ids = engine, engine.eos_ids
        self.conversations: list[list[tuple]] = []

    async def generate_one(self, prompt_ids, params):
        prompt = list(prompt_ids)
        for turns in self.conversations:
            if prompt[:len(turns[0][0])] == turns[0][0]:
                turns.append((prompt, params))
                break
        else:
            self.conversations.append([(prompt, params)])
        return await self.engine.generate_one(prompt_ids, params)


async def through_endpoint(endpoint, conversations: int, max_new_tokens: int, client: str) -> None:
    """Every conversation at once: two chat turns each, through one shared HTTP session (``aiohttp``) or
    an ``openai.AsyncOpenAI`` client per conversation (``openai``: building one costs ~20 ms of CPU,
    the client's own cost, not the endpoint's)."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def chat(handle, messages) -> dict:
            if client == "openai":
                reply = await handle.async_openai(max_retries=0).chat.completions.create(
                    model=handle.model, messages=messages, max_tokens=max_new_tokens)
                return reply.choices[0].message.model_dump(exclude_none=True)
            async with session.post(f"{handle.base_url}/chat/completions", json={
                    "model": handle.model, "messages": messages, "max_tokens": max_new_tokens},
                    headers={"Authorization": f"Bearer {handle.api_key}"}) as response:
                return (await response.json())["choices"][0]["message"]

        async def agent(index: int) -> None:
            _, handle, _ = endpoint.open(index, 0)
            messages = [{"role": "user", "content": f"Say many a's please {index}"}]
            messages += [await chat(handle, messages), {"role": "user", "content": "More"}]
            await chat(handle, messages)

        await asyncio.gather(*(agent(i) for i in range(conversations)))


async def direct(engine, requests: list[list[tuple]]) -> None:
    async def conversation(turns: list[tuple]) -> None:
        for prompt, params in turns:
            await engine.generate_one(prompt, params)

    await asyncio.gather(*(conversation(turns) for turns in requests))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--client", choices=("aiohttp", "openai"), default="aiohttp",
                        help="the agents' HTTP client: one shared aiohttp session, or an openai client per agent")
    options = parser.parse_args()
    threads = setup_environment(options.threads)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.plugins.engines.hf import HFEngine
    from rlhf.plugins.tool_parsers.hermes import parse
    from rlhf.runtime.agents.endpoint import AgentEndpoint
    from rlhf.runtime.agents.requests import RunSampling

    path = model_dir(options.model, work_dir(None))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(path)
    engine = HFEngine(model, tokenizer)
    run = RunSampling(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                      max_new_tokens=options.max_new_tokens, max_total_tokens=4096)

    print(machine_line(threads))
    endpoint_times, direct_times = [], []
    for round_ in range(options.rounds + 1):  # round 0 warms up
        recorded = Recording(engine)
        server = AgentEndpoint(recorded, tokenizer, parse, run, model_name="policy", continuous=True)
        server.start()
        wall, cpu = time.perf_counter(), time.process_time()
        asyncio.run(through_endpoint(server, options.conversations, options.max_new_tokens, options.client))
        through = (time.perf_counter() - wall, time.process_time() - cpu)
        server.stop()
        assert len(recorded.conversations) == options.conversations, len(recorded.conversations)
        wall, cpu = time.perf_counter(), time.process_time()
        asyncio.run(direct(engine, recorded.conversations))
        straight = (time.perf_counter() - wall, time.process_time() - cpu)
        if round_:
            endpoint_times.append(through)
            direct_times.append(straight)
        print(f"round {round_}: endpoint {through[0]:.2f} s wall {through[1]:.2f} s CPU; "
              f"direct {straight[0]:.2f} s wall {straight[1]:.2f} s CPU" + ("" if round_ else " (warm-up)"))
    ew, ec = median([t[0] for t in endpoint_times]), median([t[1] for t in endpoint_times])
    dw, dc = median([t[0] for t in direct_times]), median([t[1] for t in direct_times])
    print(f"median: endpoint {ew:.2f} s wall / {ec:.2f} s CPU, direct {dw:.2f} s wall / {dc:.2f} s CPU; "
          f"endpoint / direct: {ew / dw:.2f}x wall, {ec / dc:.2f}x CPU (goal <= 1.10x)")


if __name__ == "__main__":
    main()
