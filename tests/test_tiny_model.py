"""The shared tiny model loads offline through the Auto classes and generates."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.run


def test_tiny_model_round_trips_through_auto_classes(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == model.config.vocab_size == 320
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "<|pad|>"
    ids = tokenizer(["What is 12 + 7?"], return_tensors="pt")
    assert tokenizer.decode(ids.input_ids[0]) == "What is 12 + 7?"
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.input_ids.shape[1] + 4)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert torch.isfinite(model(**ids).logits).all()
