"""Tiny reward-model checkpoints in the two layouts of docs/rewards.md, built offline for the model tests."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlhf.core.plugin_host.references import import_object

ROOT = Path(__file__).resolve().parents[2]


def tokenizer():
    return import_object(f"{ROOT / 'examples' / 'tiny_model.py'}:build_tokenizer")()


def llama_config(tok, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       **extra)


def save_classifier(out: Path, tok, num_labels: int = 1) -> Path:
    """A ``LlamaForSequenceClassification`` (TRL-style reward model) with a non-trivial score head."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(llama_config(tok, num_labels=num_labels))
    with torch.no_grad():
        model.score.weight.normal_(0, 1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def save_openrlhf_layout(out: Path, tok, prefix: str = "score", in_config: bool = False) -> Path:
    """What OpenRLHF's get_llm_for_sequence_regression saves: the base model plus a Linear head under `prefix`."""
    from transformers import LlamaModel, LlamaPreTrainedModel

    class RewardModel(LlamaPreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            setattr(self, self.base_model_prefix, LlamaModel(config))
            setattr(self, prefix, nn.Linear(config.hidden_size, 1, bias=False))
            self.post_init()

    torch.manual_seed(1)
    config = llama_config(tok)
    if in_config:
        config.value_head_prefix = prefix
    model = RewardModel(config)
    with torch.no_grad():
        getattr(model, prefix).weight.normal_(0, 1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
