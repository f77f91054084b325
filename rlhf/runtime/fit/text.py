"""`TextFormatter`: how the fit loop's objectives turn dataset values into text and token ids
(``rlhf.core.protocols.objective.TextFormat``), the same way ``rlhf train`` formats prompts.

* A prompt is a string or chat messages. Under ``--apply-chat-template`` it is the tokenizer's
  chat template with the generation prompt (a string becomes one user message); otherwise a
  string, wrapped by ``--input-template`` when given.
* A response following a prompt is, under the chat template, the template of prompt + response
  minus the prompt's text (so the model learns exactly what follows the generation prompt);
  otherwise the string itself. Trailing newlines are dropped: EOS follows the last real token.
* Prompt ids are what ``rlhf train`` feeds the policy (``tokenizer(text)``, or with the chat
  template, whose text carries its own special tokens, ``add_special_tokens=False``); other texts
  are tokenized without special tokens.
* `join` puts prompt and response ids together within ``--max-len``, EOS last (OpenRLHF's
  convention): an overlong response loses its end, a prompt that leaves fewer than two tokens for
  the response is skipped.
* No text is tokenised whole beyond what ``--max-len`` could keep (`rlhf.core.inputs.text_bounds`): a
  longer prompt is skipped at once, a longer response cut to its start first.
"""

from __future__ import annotations

from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.core.protocols.objective import BadRow, SkipExample
from rlhf.core.inputs.text_bounds import char_bound, keep_start


class TextFormatter:
    def __init__(self, tokenizer: Any, *, apply_chat_template: bool = False, input_template: str | None = None,
                 max_len: int = 2048):
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no EOS token, which ends every response; pass --tokenizer with one")
        if input_template is not None and "{}" not in input_template:
            raise ConfigError(f"--input-template must contain {{}} where the prompt goes: {input_template!r}")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--apply-chat-template: the tokenizer has no chat template")
        if max_len < 3:
            raise ConfigError(f"--max-len must leave room for a prompt, a response and EOS; got {max_len}")
        self.tokenizer, self.uses_chat_template = tokenizer, apply_chat_template
        self.input_template, self.max_len = input_template, max_len
        self.eos_token_id: int = tokenizer.eos_token_id
        self.truncated = 0  # sequences that lost the end of their response

    # --- texts ------------------------------------------------------------------------------

    def prompt(self, value: Any) -> str:
        if self.uses_chat_template:
            return self._template(_messages(value, "user"), generation_prompt=True)
        if not isinstance(value, str):
            raise BadRow(_not_text("the prompt", value))
        return self.input_template.replace("{}", value) if self.input_template else value

    def response(self, prompt: Any, value: Any) -> str:
        if not self.uses_chat_template:
            if not isinstance(value, str):
                raise BadRow(_not_text("a response", value))
            return value.rstrip("\n")
        prompt_text = self.prompt(prompt)
        full = self._template(_messages(prompt, "user") + _messages(value, "assistant"), generation_prompt=False)
        return self._after(prompt_text, full)

    def conversation(self, messages: Any) -> tuple[str, str]:
        if not self.uses_chat_template:
            raise BadRow("holds a conversation (a list of messages); add --apply-chat-template")
        messages = _messages(messages, "assistant")
        if len(messages) < 2 or messages[-1].get("role") != "assistant":
            raise BadRow("a conversation must end with an assistant message that follows at least one other message")
        prompt_text = self._template(messages[:-1], generation_prompt=True)
        return prompt_text, self._after(prompt_text, self._template(messages, generation_prompt=False))

    def chat(self, messages: Any, *, generation_prompt: bool = False) -> str:
        if not self.uses_chat_template:
            raise BadRow("holds chat messages; add --apply-chat-template")
        return self._template(_messages(messages, "user"), generation_prompt=generation_prompt)

    def _template(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    @staticmethod
    def _after(prompt_text: str, full: str) -> str:
        if not full.startswith(prompt_text):
            raise BadRow("the chat template renders the conversation differently from its prompt with the generation "
                         "prompt, so the response cannot be cut out; use a template without that difference "
                         "(--chat-template FILE)")
        return full[len(prompt_text):].rstrip("\n")

    # --- token ids --------------------------------------------------------------------------

    def prompt_ids(self, text: str) -> list[int]:
        if len(text) > char_bound(self.tokenizer, self.max_len):  # more tokens than --max-len: not tokenised whole
            raise SkipExample(f"the prompt leaves no room for a response within --max-len {self.max_len}")
        if self.uses_chat_template:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text)["input_ids"])

    def ids(self, text: str) -> list[int]:
        text, _ = keep_start(text, self.tokenizer, self.max_len)  # `join` keeps at most --max-len tokens of it
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def join(self, prompt_ids: list[int], response_ids: list[int], *, eos: bool = True) -> tuple[list[int], int]:
        if len(prompt_ids) > self.max_len - 2:
            raise SkipExample(f"the prompt leaves no room for a response within --max-len {self.max_len}")
        ids = list(prompt_ids) + list(response_ids)
        if eos and (not response_ids or response_ids[-1] != self.eos_token_id):
            ids.append(self.eos_token_id)
        if len(ids) > self.max_len:
            ids = ids[:self.max_len]
            if eos:
                ids[-1] = self.eos_token_id
            self.truncated += 1
        return ids, len(prompt_ids)


def _messages(value: Any, role: str) -> list[dict[str, Any]]:
    """A string as one message of ``role``; a message or a list of messages as they are."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, dict) and "content" in m for m in value):
        raise BadRow("must be a string or a list of {role, content} messages")
    return list(value)


def _not_text(what: str, value: Any) -> str:
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return f"{what} holds chat messages, not a string; add --apply-chat-template"
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "..."
    return f"{what} must be a string (or {{role, content}} messages, with --apply-chat-template); got " \
           f"{type(value).__name__} {shown}"
