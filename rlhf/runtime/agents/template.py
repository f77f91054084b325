"""The policy tokenizer's chat template as the agent endpoint uses it: messages (OpenAI's shape) ->
the text and token ids the policy continues, the template's end-of-turn, and the key under which
two messages count as the same (the recorder compares a request's history with what it recorded).
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
_MARK = "\u2063agent-mark\u2063"  # content no template alters, to find what a template puts after it


class ChatTemplate:
    """Renders conversations with ``tokenizer.apply_chat_template`` (``tools=`` passed through)."""

    def __init__(self, tokenizer: Any, eos_ids: set[int] | None = None):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids or ()) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.end_of_turn = self._end_of_turn()  # "<|im_end|>\n": what the template writes after an assistant's text
        self.marker = self.end_of_turn.strip()  # "<|im_end|>": counted to find a turn's end ("" when none)
        # the marker is an EOS token of the model (Qwen's <|im_end|>), so EOS ends a turn without a stop string
        self.marker_is_eos = bool(self.marker) and any(
            tokenizer.decode([i], skip_special_tokens=False) == self.marker for i in self.eos_ids)

    def _end_of_turn(self) -> str:
        text = self.text([{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}], None,
                         generation_prompt=False)
        return text[text.rfind(_MARK) + len(_MARK):] if _MARK in text else ""

    def text(self, messages: list[dict], tools: list[dict] | None, *, generation_prompt: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template([for_template(m) for m in messages], tokenize=False,
                                                  add_generation_prompt=generation_prompt, **kwargs)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def labelled_ids(self, text: str, messages: list[dict]) -> tuple[list[int], list[str]]:
        """``text``'s token ids and where each came from: the role of the message whose text it
        renders (``user``, ``tool``, ``system``, ``assistant`` for an assistant turn the model did not
        sample in this sequence), else ``template``. The messages' texts are looked for in order."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans, at = [], 0
        for message in messages:
            content = content_text(message.get("content"))
            found = text.find(content, at) if content else -1
            if found >= 0:
                spans.append((found, found + len(content), message.get("role", "user")))
                at = found + len(content)
        origins = []
        for start, end in encoded["offset_mapping"]:
            origins.append(next((role for a, b, role in spans if start < b and end > a), "template"))
        return list(encoded["input_ids"]), origins

    def decode(self, ids: list[int], *, special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special)

    def eos_texts(self) -> list[str]:
        """The texts of the eos tokens that are not the template's end-of-turn marker."""
        texts = [self.tokenizer.decode([i], skip_special_tokens=False) for i in sorted(self.eos_ids)]
        return [t for t in texts if t and t != self.marker]


def for_template(message: dict) -> dict:
    """A message as chat templates expect it: content a string, tool-call arguments a dict."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = content_text(message.get("content"))
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


def content_text(content: Any) -> str:
    """OpenAI content (a string, None, or a list of ``{"type": "text", "text": ...}`` parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def message_key(message: dict) -> tuple:
    """What makes two messages the same turn: role, text (surrounding whitespace aside) and tool calls
    (name and arguments as JSON values, so re-serialised arguments and new call ids still match)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), content_text(message.get("content")).strip(), tuple(calls)
