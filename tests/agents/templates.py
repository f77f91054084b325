"""Chat templates for the agent tests, on the tiny tokenizer (whose own template renders no tools)."""

# Renders earlier turns the way Qwen-style templates do: reasoning (``<think>...</think>``) stripped
# from assistant turns, tool calls re-serialised with ``tojson`` (", " and ": " separators), tools in a
# system turn. A model that writes compact JSON or reasons never sees its own text rendered back.
REWRITING = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{% set c = m['content'] %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}"
    "<|im_start|>assistant\n{{ c }}"
    "{% for tc in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': tc['function']['name'], 'arguments': tc['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Renders every turn as the model wrote it (tool calls as the model's text, which the test makes the
# content), so a follow-up request's rendering starts with the recorded tokens.
FAITHFUL = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
