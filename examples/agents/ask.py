"""The smallest agent: ask the policy the dataset's question through its OpenAI endpoint, score the
answer against the label. Written with the standard library only, so it shows the protocol; an agent
written with the ``openai`` SDK is ``endpoint.openai().chat.completions.create(...)`` (docs/agents.md).

    rlhf train --algo grpo --model ./examples/tiny-model --data examples/data/train.jsonl \\
        --input-key prompt --label-key answer --agent examples/agents/ask.py:solve --out runs/ask
"""

from __future__ import annotations

import json
import urllib.request


def chat(endpoint, messages: list[dict], **options) -> dict:
    """One ``POST {base_url}/chat/completions``; returns the assistant's message."""
    body = json.dumps({"model": endpoint.model, "messages": messages, **options}).encode()
    request = urllib.request.Request(f"{endpoint.base_url}/chat/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {endpoint.api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]


def solve(sample: dict, endpoint) -> float:
    """1.0 when the policy's answer to the prompt, stripped, equals the label, else 0.0."""
    answer = chat(endpoint, [{"role": "user", "content": sample["prompt"]}])["content"] or ""
    return float(answer.strip() == str(sample.get("answer", "")).strip())
