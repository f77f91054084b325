"""Agents the rollout tests call by reference (``--agent tests/agents/agents.py:NAME``)."""

from __future__ import annotations

import asyncio
import time

from rlhf.api import AgentResult


def solve(sample, endpoint):
    """Two turns through the openai client; the reward is the answer's length mod 3 (it varies)."""
    client = endpoint.openai()
    messages = [{"role": "user", "content": sample["prompt"]}]
    first = client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again"}]
    second = client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=4)
    return AgentResult(reward=float(len(second.choices[0].message.content or "") % 3), info={"turns": 2})


async def solve_async(sample, endpoint):
    """The same with the async client."""
    client = endpoint.async_openai()
    reply = await client.chat.completions.create(model=endpoint.model, max_tokens=4,
                                                 messages=[{"role": "user", "content": sample["prompt"]}])
    return float(len(reply.choices[0].message.content or "") % 2)


def fails_sometimes(sample, endpoint):
    """One request, then: raises on prompts with an even first number, hangs on those ending in 5,
    returns NaN on those ending in 7, else 1.0."""
    endpoint.openai().chat.completions.create(model=endpoint.model, max_tokens=3,
                                              messages=[{"role": "user", "content": sample["prompt"]}])
    first = int(sample["prompt"].split("+")[0])
    if first % 2 == 0:
        raise ValueError(f"the tool crashed on {first}\nsecond line of the traceback")
    if first % 10 == 5:
        time.sleep(30)
    if first % 10 == 7:
        return float("nan")
    return 1.0


async def hangs(sample, endpoint):
    await asyncio.sleep(60)


_calls = __import__("threading").Lock()


def signals_once(sample, endpoint):
    """One turn, no reward of its own (the run's --reward scores it); the call numbered $SIGNAL_ON_CALL
    (counted in $CALLS_FILE) sends SIGINT to its own process first, as a Ctrl-C during agent calls."""
    import os
    import signal
    from pathlib import Path

    with _calls:
        counter = Path(os.environ["CALLS_FILE"])
        calls = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(calls))
    if calls == int(os.environ.get("SIGNAL_ON_CALL", "0")):
        os.kill(os.getpid(), signal.SIGINT)
    endpoint.openai().chat.completions.create(model=endpoint.model, max_tokens=4,
                                              messages=[{"role": "user", "content": sample["prompt"]}])
    return None


def branches(sample, endpoint):
    """Two requests; the second replaces the first reply with a summary (an edited history): two
    sequences, the trajectory's own and one segment."""
    client = endpoint.openai()
    messages = [{"role": "user", "content": sample["prompt"]}]
    client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=4)
    edited = [*messages, {"role": "assistant", "content": "(summary)"}, {"role": "user", "content": "Again"}]
    second = client.chat.completions.create(model=endpoint.model, messages=edited, max_tokens=4)
    return float(len(second.choices[0].message.content or "") % 3)


def dies_once(sample, endpoint):
    """Two turns, its reward the second answer's length mod 3; the call numbered $KILL_ON_CALL
    (counted in $CALLS_FILE) kills its own process with SIGKILL between its two requests: kill -9
    during agent calls."""
    import os
    import signal
    from pathlib import Path

    with _calls:  # the count replaced whole (os.replace), so the kill never leaves a half-written file
        counter = Path(os.environ["CALLS_FILE"])
        calls = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.with_suffix(".tmp").write_text(str(calls))
        os.replace(counter.with_suffix(".tmp"), counter)
    client = endpoint.openai()
    messages = [{"role": "user", "content": sample["prompt"]}]
    first = client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=4)
    if calls == int(os.environ.get("KILL_ON_CALL", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again"}]
    second = client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=4)
    return float(len(second.choices[0].message.content or "") % 3)


def solve_noting_where(sample, endpoint):
    """`solve`, after appending ``PID PORT`` (the process this call runs in, its endpoint's port) to the
    file the row's ``where`` column names: which process served which agents."""
    import os
    from urllib.parse import urlparse

    with _calls, open(sample["where"], "a") as out:
        out.write(f"{os.getpid()} {urlparse(endpoint.base_url).port}\n")
    return solve(sample, endpoint)
