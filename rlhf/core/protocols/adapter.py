"""The model-adapter contract (``register_models``): how a run gets its models and writes them out.

The runtime creates ``adapter_cls(config)`` once per process, then calls ``load_tokenizer(ref)``
and ``load(ref, role=ROLE)`` for each role it needs, ``policy`` first, on the same instance
(``ref``: a local directory or a hub name). Roles:

* ``policy``: a trainable causal LM (``model(input_ids, attention_mask).logits`` and ``generate``);
* ``reference``: a frozen causal LM. It may share the policy's weights (LoRA: the policy with its
  adapter switched off), so it must not change the policy's trainability or mode, and must share
  no *trainable* parameter with it;
* ``critic``: a module with ``forward(input_ids, attention_mask) -> values (B, T)`` float32, the
  value of the state that ends at each token;
* ``reward``: like ``critic`` (a scalar per position), trained by ``rlhf rm``; ``save`` writes it
  as a one-label sequence classifier that ``AutoModelForSequenceClassification`` loads.

At the end of a run ``save(model, tokenizer, out_dir)`` writes the final policy and, with
``--save-critic``, ``save_critic(model, tokenizer, out_dir)`` the critic: directories that
``from_pretrained`` loads. The registration flag ``roles`` lists the roles an adapter builds.
`ModelAdapterBase` saves with ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class ModelAdapter(Protocol):
    def load_tokenizer(self, ref: str) -> Any:
        """The tokenizer, with a pad token set."""

    def load(self, ref: str, *, role: str) -> torch.nn.Module:
        """The model of one role (``policy``, ``reference``, ``critic``, ``reward``)."""

    def save(self, model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> None:
        """Write the trained policy (and its tokenizer) as a directory ``from_pretrained`` loads."""

    def save_critic(self, model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> None:
        """Write the trained critic."""


class ModelAdapterBase:
    """Default outputs: ``save_pretrained`` of the model and the tokenizer."""

    def save(self, model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> None:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    def save_critic(self, model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> None:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
