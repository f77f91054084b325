"""``rlhf chat MODEL``: an interactive conversation with any model directory (docs/generate.md).

Each turn is formatted with the tokenizer's chat template over the whole history (an optional
``--system`` message first), or, with ``--input-template`` or ``--no-apply-chat-template``, as the
concatenation of every past turn's filled template and answer (plain text: each past turn ended
by EOS, as a plain-prompt model saw every prompt and answer in training). The default is the
format the model was trained with (its ``prompt_format.json``), else the chat template when the
tokenizer has one. Answers are sampled with temperature / top-p and streamed to
the terminal as they are generated. A LoRA adapter directory (``adapter_config.json``) loads its
base model with the adapter on top. Commands: ``/reset`` forgets the history, ``/exit`` (or
Ctrl-D) quits. When the conversation outgrows the model's context, the oldest turns are dropped
(keeping ``--max-new-tokens`` or half the context for the answer), and an answer never runs past
the context: its new tokens are capped at what the prompt leaves, and a message that leaves
nothing is refused with a line saying so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.core.modeling import check_model_ref, reading_weights, resolve_device

PROMPT = "> "


@dataclass(kw_only=True)
class ChatSettings:
    system: str | None = None
    apply_chat_template: bool | None = None  # None: when the tokenizer has a chat template and no input template
    input_template: str | None = None
    tokenizer: str | None = None
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        """The sampling settings' ranges, as ``rlhf generate`` checks them, before any model loads."""
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1; got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be at least 0 (0: greedy); got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] (1: off); got {self.top_p}")


def load_model(ref: str, settings: ChatSettings) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for inference: a full model directory or hub name, or a LoRA adapter
    directory (its base model from ``adapter_config.json``, with the adapter applied)."""
    import torch
    import transformers

    device = resolve_device(settings.device)
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if settings.dtype == "auto" \
        else getattr(torch, names.get(settings.dtype, settings.dtype))
    check_model_ref(ref)
    path = Path(ref)
    adapter = (path / "adapter_config.json").is_file()
    base = ref
    if adapter:
        from peft import PeftConfig

        base = PeftConfig.from_pretrained(ref).base_model_name_or_path
        if not base:
            raise ConfigError(f"{ref}/adapter_config.json names no base model")
    has_tokenizer = any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer_ref = settings.tokenizer or (ref if not adapter or has_tokenizer else base)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_ref,
                                                               trust_remote_code=settings.trust_remote_code)
        with reading_weights(base):
            model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype,
                                                                      trust_remote_code=settings.trust_remote_code)
    except OSError as exc:
        raise ConfigError(f"cannot load {ref}: {exc}") from exc
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, ref)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device).eval()
    if device.type == "cpu":
        from rlhf.fastpaths.cpu_linear import use_onednn_linears

        use_onednn_linears(model)
    return model, tokenizer


class Conversation:
    """The history and how it becomes the model's input text."""

    def __init__(self, tokenizer: Any, settings: ChatSettings):
        if settings.input_template is not None and "{}" not in settings.input_template:
            raise ConfigError(f"--input-template must contain {{}} where the message goes: {settings.input_template!r}")
        self.tokenizer, self.settings = tokenizer, settings
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if settings.apply_chat_template and settings.input_template is not None:
            raise ConfigError("--apply-chat-template and --input-template are two ways to format a turn: pass one")
        if settings.apply_chat_template and not has_template:
            raise ConfigError("--apply-chat-template: the tokenizer has no chat template")
        self.use_template = settings.apply_chat_template if settings.apply_chat_template is not None else (
            settings.input_template is None and has_template)
        self.turns: list[tuple[str, str]] = []  # (user, assistant)

    def reset(self) -> None:
        self.turns = []

    def text(self, message: str, turns: list[tuple[str, str]] | None = None) -> str:
        turns = self.turns if turns is None else turns
        system = self.settings.system
        if self.use_template:
            messages = [{"role": "system", "content": system}] if system else []
            for user, assistant in turns:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            messages.append({"role": "user", "content": message})
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        template = self.settings.input_template or "{}"
        end = "" if self.settings.input_template is not None else self.turn_end()
        past = "".join(template.replace("{}", user) + assistant + end for user, assistant in turns)
        return (system + "\n" if system else "") + past + template.replace("{}", message)

    def turn_end(self) -> str:
        """What ends a past turn in plain text: a model trained on plain prompts saw each prompt and
        answer as one sequence, ended by EOS (and the next one begun by BOS where the tokenizer adds
        it), so its turns are kept apart the same way; without an EOS token, a newline."""
        eos, bos = getattr(self.tokenizer, "eos_token", None), getattr(self.tokenizer, "bos_token", None)
        if not eos:
            return "\n"
        bos_id = getattr(self.tokenizer, "bos_token_id", None)
        adds_bos = bos is not None and bos_id is not None and self.tokenizer("a")["input_ids"][:1] == [bos_id]
        return eos + (bos if adds_bos else "")

    def ids(self, message: str, budget: int) -> list[int]:
        """The input ids for ``message`` after the history, the oldest turns dropped to fit ``budget``
        (the message itself is never cut: it may still be longer)."""
        turns = list(self.turns)
        while True:
            text = self.text(message, turns)
            ids = self.tokenizer(text, add_special_tokens=not self.use_template)["input_ids"]
            if len(ids) <= budget or not turns:
                return list(ids)
            turns = turns[1:]


def history_budget(context: int, max_new_tokens: int) -> int:
    """Prompt tokens the history may fill: the context less the room kept for an answer, which is
    ``max_new_tokens`` or half the context, whichever is less."""
    return max(1, context - min(max_new_tokens, context // 2))


def answer_tokens(context: int, prompt_tokens: int, max_new_tokens: int) -> int:
    """New tokens an answer may have after a prompt of ``prompt_tokens``: ``max_new_tokens`` capped at
    the context left (0: no room at all)."""
    return max(0, min(max_new_tokens, context - prompt_tokens))


def run_chat(ref: str, settings: ChatSettings, *, stdin: Any = None, stdout: Any = None) -> None:
    """The REPL: read a line, answer it (streamed), until /exit or end of input."""
    import torch
    from transformers import TextStreamer

    from rlhf.runtime.config.options import check_sampling

    stdout = stdout or sys.stdout
    check_sampling(settings.top_k, settings.repetition_penalty)
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    model, tokenizer = load_model(ref, settings)
    conversation = Conversation(tokenizer, settings)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 4096
    budget = history_budget(context, settings.max_new_tokens)
    how = "its chat template" if conversation.use_template else (
        "--input-template" if settings.input_template else "plain text, no chat template")
    print(f"chatting with {ref} ({how}); /reset forgets the conversation, /exit quits", file=stdout, flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    device = next(model.parameters()).device
    while True:
        try:
            message = input(PROMPT) if stdin is None else _read(stdin, stdout)
        except (EOFError, KeyboardInterrupt):
            print(file=stdout, flush=True)
            return
        message = message.strip()
        if not message:
            continue
        if message in ("/exit", "/quit"):
            return
        if message == "/reset":
            conversation.reset()
            print("(conversation reset)", file=stdout, flush=True)
            continue
        ids = torch.tensor([conversation.ids(message, budget)], device=device)  # (1, P)
        new_tokens = answer_tokens(context, ids.shape[1], settings.max_new_tokens)
        if new_tokens == 0:
            print(f"(that message is {ids.shape[1]} tokens and the model's context is {context}: no room is left "
                  "for an answer; send a shorter one)", file=stdout, flush=True)
            continue
        sampling = {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p,
                    "top_k": settings.top_k} if settings.temperature > 0 else {"do_sample": False}
        with torch.inference_mode():
            output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                                    max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
                                    repetition_penalty=settings.repetition_penalty, **sampling)
        answer = tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)
        conversation.turns.append((message, answer))
        stdout.flush()


def _read(stdin: Any, stdout: Any) -> str:
    print(PROMPT, end="", file=stdout, flush=True)
    line = stdin.readline()
    if not line:
        raise EOFError
    return line
