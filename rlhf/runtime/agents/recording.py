"""Token-exact recording of one agent call's requests (docs/agents.md, "Recording").

A trajectory's requests become one or more **sequences**. Each holds token ids, a loss mask (1 on
the tokens the policy sampled, 0 on template, system, user and tool tokens) and the sampled tokens'
log-probs, plus a checkpoint after each completion: how many tokens and which messages (the request's
and the reply as the agent would send it back) it held then.

A new request is matched against every checkpoint: its messages must start with the checkpoint's
(`rlhf.runtime.agents.template.message_key`: role, text, tool calls as JSON values). The longest
match wins:

* it is the last checkpoint of a sequence no other request is extending: the request **extends**
  that sequence. The conversation is rendered with the template; when the rendering starts with the
  recorded tokens, what follows them is appended (exact). When it does not (the template re-renders
  an earlier turn: reasoning stripped, tool-call JSON re-serialised, another end-of-turn), the
  recorded tokens are kept and spliced in: the template's end-of-turn is completed after the model's
  last token, and the rendering of the new messages (found after as many end-of-turn markers as the
  recorded part holds) is appended. That request counts as **drift** (repaired);
* it is an earlier checkpoint (the agent edited or dropped later turns), or a request is already
  extending that sequence: a **branch**, a new sequence that starts with the checkpoint's tokens,
  all with loss mask 0 (the first sequence trains them), and continues as above;
* nothing matches (the first request, or a history edited from its first assistant turn on): a new
  sequence from the rendered conversation.

A rendering the splice cannot place (no end-of-turn marker, or a different number of turns) starts a
new sequence too, counted as drift. Model tokens are never re-tokenised. ``/v1/completions`` works on
token ids: a prompt that starts with a sequence's tokens extends it, any other starts a new one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from rlhf.runtime.agents.template import ChatTemplate, message_key


@dataclass(eq=False)
class Sequence:
    """One sequence of a trajectory: tokens, loss mask, log-probs and its checkpoints."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # per token: "model" (sampled here), "template", the role of the message it renders, or "prompt"
    # (a /v1/completions prompt); "model" tokens a branch shares with its first sequence become "shared"
    origins: list[str] = field(default_factory=list)
    # per token: the policy version that sampled it (the steps its weights had taken), None where no
    # policy sampled it (template, messages, prompt)
    versions: list[int | None] = field(default_factory=list)
    # after each completion: (tokens held, message keys held; None for a /v1/completions request)
    checkpoints: list[tuple[int, tuple | None]] = field(default_factory=list)
    busy: bool = False  # a request extending it is being generated
    finish_reason: str = "stop"

    def extend(self, ids: list[int], *, model: bool, logprobs: list[float] | None = None,
               origins: list[str] | None = None, version: int | None = None) -> None:
        self.tokens += ids
        self.versions += [version if model else None] * len(ids)
        self.mask += [1 if model else 0] * len(ids)
        self.logprobs += list(logprobs) if model and logprobs is not None else [0.0] * len(ids)
        self.origins += ["model"] * len(ids) if model else list(origins or ["template"] * len(ids))

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)


@dataclass(eq=False)
class Prompt:
    """A request's place in the trajectory: its sequence and the tokens the policy continues."""

    sequence: Sequence
    keys: tuple | None  # the request's message keys (None: /v1/completions)

    @property
    def ids(self) -> list[int]:
        return self.sequence.tokens


class TrajectoryRecord:
    """Every request of one trajectory (thread-safe: requests of one trajectory may overlap)."""

    def __init__(self, template: ChatTemplate, policy_version: int | None = None):
        self.template = template
        self.policy_version = policy_version  # of the weights serving its requests, stamped on each model token
        self.sequences: list[Sequence] = []
        self.requests = 0  # completions recorded
        self.follow_ups = 0  # requests that continued a recorded sequence
        self.drift = 0  # of those, requests the template rendered differently (spliced, or a new sequence)
        self.parse_failures: list[str] = []
        self.lock = threading.Lock()

    # --- placing a request ------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None) -> Prompt:
        """The sequence a chat request continues, with its rendered prompt appended (loss mask 0)."""
        keys = tuple(message_key(m) for m in messages)
        text_full = self.template.text(messages, tools, generation_prompt=True)  # a template error changes nothing
        ids_full, origins = self.template.labelled_ids(text_full, messages)
        with self.lock:
            found = self._match(keys)
            if found is None:
                return self._fresh(text_full, messages, keys)
            sequence, at, held = found
            target = self._claim(sequence, at)
            try:
                return self._continue(target, sequence, messages, tools, keys, held, text_full, ids_full, origins)
            except BaseException:
                self._release(target, sequence)
                raise

    def _continue(self, target: Sequence, sequence: Sequence, messages: list[dict], tools: list[dict] | None,
                  keys: tuple, held: tuple, text_full: str, ids_full: list[int], origins: list[str]) -> Prompt:
        """``target`` (``sequence`` or its branch) continued with a request's rendering: exact, spliced, or
        (when the splice cannot be placed) a new sequence."""
        self.follow_ups += 1
        recorded = target.tokens
        if ids_full[:len(recorded)] == recorded:
            target.extend(ids_full[len(recorded):], model=False, origins=origins[len(recorded):])
            return Prompt(target, keys)
        spliced = self._splice(recorded, messages[:len(held)], tools, text_full)
        if spliced is None:  # the template's turns could not be placed: a new sequence, counted
            self.drift += 1
            self._release(target, sequence)
            return self._fresh(text_full, messages, keys)
        glue, suffix, drifted = spliced
        glue_ids = self.template.ids(glue)
        suffix_ids, suffix_origins = self.template.labelled_ids(suffix, messages[len(held):])
        self.drift += drifted
        target.extend(glue_ids, model=False)
        target.extend(suffix_ids, model=False, origins=suffix_origins)
        return Prompt(target, keys)

    def token_prompt(self, ids: list[int]) -> Prompt:
        """The sequence a ``/v1/completions`` request (token ids) continues."""
        with self.lock:
            best = None
            for sequence in self.sequences:
                for tokens, _ in sequence.checkpoints:
                    if tokens <= len(ids) and ids[:tokens] == sequence.tokens[:tokens] and \
                            (best is None or tokens > best[1]):
                        best = (sequence, tokens)
            if best is None:
                sequence = Sequence()
                sequence.extend(list(ids), model=False, origins=["prompt"] * len(ids))
                sequence.busy = True
                self.sequences.append(sequence)
                return Prompt(sequence, None)
            self.follow_ups += 1
            target = self._claim(best[0], best[1])
            target.extend(list(ids[best[1]:]), model=False, origins=["prompt"] * (len(ids) - best[1]))
            return Prompt(target, None)

    def _match(self, keys: tuple) -> tuple[Sequence, int, tuple] | None:
        """The longest checkpoint whose messages start ``keys``: (sequence, tokens held, its keys)."""
        best = None
        for sequence in self.sequences:
            for tokens, held in sequence.checkpoints:
                if held is not None and len(held) <= len(keys) and keys[:len(held)] == held and \
                        (best is None or len(held) >= len(best[2])):
                    best = (sequence, tokens, held)
        return best

    def _claim(self, sequence: Sequence, at: int) -> Sequence:
        """The sequence to append to: ``sequence`` itself when ``at`` is its end and no request is
        extending it, else a branch holding its first ``at`` tokens with loss mask 0."""
        if not sequence.busy and at == len(sequence.tokens):
            sequence.busy = True
            return sequence
        branch = Sequence(busy=True)
        branch.extend(sequence.tokens[:at], model=False,
                      origins=["shared" if o == "model" else o for o in sequence.origins[:at]])
        branch.versions[:] = sequence.versions[:at]  # shared tokens keep the version that sampled them
        self.sequences.append(branch)
        return branch

    def _release(self, target: Sequence, sequence: Sequence) -> None:
        if target is sequence:
            target.busy = False
        else:
            self.sequences.remove(target)

    def _fresh(self, text: str, messages: list[dict], keys: tuple) -> Prompt:
        sequence = Sequence(busy=True)
        ids, origins = self.template.labelled_ids(text, messages)
        sequence.extend(ids, model=False, origins=origins)
        self.sequences.append(sequence)
        return Prompt(sequence, keys)

    def _splice(self, recorded: list[int], held: list[dict], tools: list[dict] | None,
                text_full: str) -> tuple[str, str, bool] | None:
        """(glue, suffix, drifted): the end-of-turn text the model's tokens lack, and the rendering of the
        new messages, found in ``text_full`` after as many end-of-turn markers as the recorded
        conversation (``held``, ending with the model's reply) renders; None when it cannot be placed."""
        template = self.template
        marker, end = template.marker, template.end_of_turn
        if not marker:
            return None
        text_held = template.text(held, tools, generation_prompt=False)
        count = text_held.count(marker)
        if count == 0 or text_full.count(marker) < count:
            return None
        at = -1
        for _ in range(count):
            at = text_full.index(marker, at + 1)
        split = at + len(marker)
        tail = text_held[text_held.rfind(marker) + len(marker):]  # what follows the marker: "\n"
        if not text_full.startswith(tail, split):
            return None
        split += len(tail)
        recorded_text = template.decode(recorded)
        glue = end
        for k in range(len(end), 0, -1):  # the end-of-turn the model's tokens already hold
            if recorded_text.endswith(end[:k]):
                glue = end[k:]
                break
        seen = recorded_text + glue
        for eos in template.eos_texts():
            seen = seen.replace(eos, "")
        return glue, text_full[split:], seen != text_full[:split]

    # --- recording a completion ---------------------------------------------------------------

    def record(self, prompt: Prompt, ids: list[int], logprobs: list[float] | None, reply: dict | None,
               finish_reason: str) -> None:
        """The policy's tokens of one completion (loss mask 1) and the checkpoint after them; ``reply``:
        the assistant message as the agent will send it back (None for /v1/completions)."""
        with self.lock:
            sequence = prompt.sequence
            sequence.extend(list(ids), model=True, logprobs=logprobs if logprobs is not None else [0.0] * len(ids),
                            version=self.policy_version)
            keys = None if prompt.keys is None or reply is None else prompt.keys + (message_key(reply),)
            sequence.checkpoints.append((len(sequence.tokens), keys))
            sequence.finish_reason = finish_reason
            sequence.busy = False
            self.requests += 1

    def abandon(self, prompt: Prompt) -> None:
        """A request that produced nothing (the engine failed, the client left): its sequence is free
        again; a sequence it created without a checkpoint is dropped."""
        with self.lock:
            sequence = prompt.sequence
            sequence.busy = False
            if not sequence.checkpoints:
                if sequence in self.sequences:
                    self.sequences.remove(sequence)
                return
            keep = sequence.checkpoints[-1][0]  # back to the last completion: its prompt tokens go
            del sequence.tokens[keep:], sequence.mask[keep:], sequence.logprobs[keep:], sequence.origins[keep:]
            del sequence.versions[keep:]

    # --- what the rollout takes -----------------------------------------------------------------

    def trained_sequences(self) -> list[Sequence]:
        """The sequences holding model tokens, in the order they started."""
        return [s for s in self.sequences if s.model_tokens]
