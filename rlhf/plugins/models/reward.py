"""A reward model in training: a transformer backbone plus a linear ``score`` head, saved as a
one-label ``*ForSequenceClassification`` directory.

In training it is a `CriticModel` (the same backbone + ``nn.Linear(hidden, 1)`` head, a value per
position ``(B, T)``; the fit loop's objectives read the value at each sequence's last real token).
Initialised like OpenRLHF's ``get_llm_for_sequence_regression``: from a reward-model checkpoint,
its head; from any other model, a fresh head drawn from N(0, 1/(H+1)).

Saved in the Hugging Face layout, so ``AutoModelForSequenceClassification.from_pretrained`` loads
it and scores what ``rlhf train --reward DIR`` scores: the backbone's weights under the classifier
class's ``base_model_prefix`` (LoRA merged in), the head as ``score.weight``, ``num_labels: 1``
and the tokenizer's pad token in config.json. The classifier class is the one transformers maps
the backbone's config to (``LlamaConfig`` -> ``LlamaForSequenceClassification``); its
``score`` head must be what that class calls its head.

Shape legend: ``B`` sequences, ``T`` tokens, ``H`` hidden size.
"""

from __future__ import annotations

import copy
from pathlib import Path
import torch

from rlhf.api import ConfigError
from rlhf.plugins.models.critic import CriticModel
from rlhf.plugins.models.lora import merged_state_dict


class RewardModel(CriticModel):
    """Backbone + ``score`` head; ``forward(input_ids, attention_mask) -> values (B, T)``."""

    def save_pretrained(self, out_dir: str | Path, pad_token_id: int | None = None) -> None:
        from transformers import AutoModelForSequenceClassification

        backbone = self.backbone
        if hasattr(backbone, "peft_config"):
            state, backbone = merged_state_dict(backbone), backbone.get_base_model()
        else:
            state = dict(backbone.state_dict())
        config = copy.deepcopy(backbone.config)
        try:
            classifier_cls = AutoModelForSequenceClassification._model_mapping[type(config)]
        except KeyError:
            raise ConfigError(f"transformers has no sequence-classification class for {type(config).__name__}, so the "
                              "reward model cannot be saved in the classifier layout") from None
        config.architectures = [classifier_cls.__name__]
        config.num_labels = 1
        config.id2label, config.label2id = {0: "LABEL_0"}, {"LABEL_0": 0}
        if pad_token_id is not None:
            config.pad_token_id = pad_token_id
        prefix = classifier_cls.base_model_prefix
        weights = {f"{prefix}.{name}": tensor for name, tensor in state.items()}
        weights.update({f"score.{name}": tensor for name, tensor in self.head.state_dict().items()})
        with torch.device("meta"):
            classifier = classifier_cls(config)
        missing, unexpected = classifier.load_state_dict(weights, strict=False, assign=True)
        if missing or unexpected:
            raise ConfigError(f"{classifier_cls.__name__} does not match the trained reward model (missing: "
                              f"{', '.join(missing[:5]) or 'none'}; unexpected: {', '.join(unexpected[:5]) or 'none'})")
        classifier.save_pretrained(out_dir)

