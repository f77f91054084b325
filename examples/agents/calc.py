"""A calculator agent written with the ``openai`` SDK's tool calling: the policy is asked a product
("23*47"), may call the ``calc`` tool, gets its result back as a tool message, and answers. The
reward is 1 when the final answer is the product, else 0. The tiny model made by
``examples/agents/make_calc_model.py`` cannot multiply, so it scores only through the tool, which
it rarely calls before training: GRPO teaches it to.

    python examples/agents/make_calc_model.py
    rlhf train --algo grpo --model examples/agents/calc-model --data examples/agents/data/train.jsonl \\
        --input-key prompt --agent examples/agents/calc.py:solve --n-samples 8 --prompts-per-step 8 \\
        --max-new-tokens 16 --lr 1e-3 --steps 60 --out runs/calc

Any OpenAI-compatible client works the same way against ``endpoint.base_url`` (docs/agents.md).
"""

from __future__ import annotations

import ast
import json
import operator

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression such as 23*47.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TURNS = 3  # model turns per problem: call the tool, answer (and one spare)

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def calculate(expression: str) -> str:
    """Integer arithmetic (+ - * //) on the expression, or an error message the model can read."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("unsupported")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError):
        return "error"


def solve(sample: dict, endpoint) -> float:
    """1.0 when the model's final answer equals the product (``sample["answer"]``), else 0.0."""
    client = endpoint.openai()
    messages = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=endpoint.model, messages=messages, tools=TOOLS, max_tokens=16)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == str(sample["answer"]))
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            result = calculate(str(expression)) if call.function.name == "calc" else "unknown tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
