"""A rollout engine for the data-generation tests whose samples say what they are.

Sample s of prompt ``p`` (s counts the prompt's samples within one call, whether asked for with
``n`` or by repeating the prompt, as a rollout does) is the text ``" r=<value> #<draw>"``:
``value`` is ``SCRIPT[p][s]`` (a number, or ``none`` for a sample the `score` reward abstains
on), ``draw`` a number drawn from torch's global random stream as the sample is made (so a sample
shows which seed it was drawn under, and two samples drawn from one stream differ). `score` reads
the value back: the rewards of every command are known by hand. Every call is recorded in ``ScriptedEngine.calls``.

Registered as ``scripted`` by `scripted_plugin`.
"""

from __future__ import annotations

import types
from typing import Any

import torch

import rlhf
from rlhf.core.protocols.rollout import Generation

# prompt -> the value of each sample, in order (--n 4)
SCRIPT = {
    "p0": ["1", "3", "3", "0"],  # best: sample 1 (the first of two 3s); worst: sample 3
    "p1": ["2", "2", "2", "2"],  # every sample ties
    "p2": ["none", "5", "none", "-1"],  # abstentions never win: best sample 1, worst sample 3
    "p3": ["none", "none", "none", "none"],  # nothing scored
    "p4": ["0.5", "4", "1", "4"],  # best: sample 1 (the first of two 4s); worst: sample 0
}
PROMPTS = [{"prompt": p, "answer": f"a{i}", "topic": "t"} for i, p in enumerate(SCRIPT)]
# Sample s of a prompt ends by length (not EOS) when s is in LENGTH_ENDED.
LENGTH_ENDED = {3}

REWARDS = '''
def score(completions, **kwargs):
    values = [c.split("r=")[1].split()[0] for c in completions]
    return [None if v == "none" else float(v) for v in values]

def bonus(completions, labels, **kwargs):  # abstains but on the prompts labelled a0 and a3
    return [0.5 if l in ("a0", "a3") else None for l in labels]
'''


def value(text: str) -> float | None:
    """The value a sample's text carries (what `score` returns for it)."""
    raw = text.split("r=")[1].split()[0]
    return None if raw == "none" else float(raw)


def draw(text: str) -> int:
    return int(text.split("#")[1])


class ScriptedEngine:
    """Samples as the module docstring says; the policy's weights change nothing."""

    shares_weights = True
    calls: list[dict[str, Any]] = []  # every instance's generate calls, in order

    def __init__(self, model: Any, tokenizer: Any, config: Any = None):
        self.tokenizer = tokenizer

    def generate(self, prompts: list[list[int]], *, n: int, params: Any) -> list[Generation]:
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in prompts]
        out, made = [], []
        for index, text in enumerate(texts):
            script = SCRIPT[text.rsplit(" ", 1)[-1]]  # the prompt's own word (after any template)
            before = texts[:index].count(text)  # a rollout asks for each sample as a prompt of its own (n=1)
            for s in range(before * n, before * n + n):
                completion = f" r={script[s % len(script)]} #{int(torch.randint(0, 10 ** 9, ()))}"
                tokens = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
                length_ended = s in LENGTH_ENDED
                out.append(Generation(token_ids=tokens + ([] if length_ended else [self.tokenizer.eos_token_id]),
                                      finish_reason="length" if length_ended else "stop"))
                made.append(completion)
        type(self).calls.append({"prompts": texts, "n": n, "params": params, "completions": made})
        return out

    def load_weights(self, state: Any = None) -> None:
        """Nothing to load: the samples do not depend on the weights."""


def scripted_plugin() -> types.ModuleType:
    module = types.ModuleType("scripted_engine_plugin")
    module.register_rollout_engines = rlhf.hookimpl(lambda register: register("scripted", ScriptedEngine))
    return module
