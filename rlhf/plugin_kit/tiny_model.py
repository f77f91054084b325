"""Tiny random-weight Llama models with a byte-level BPE tokenizer, built offline in seconds.

``rlhf plugins check`` runs model adapters, engines, backends and objectives on one; the tests
and ``examples/tiny_model.py`` build theirs with the same functions. The config is a
``LlamaConfig`` because ``AutoTokenizer`` keeps our tokenizer for it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT_CORPUS = [
    "What is 12 + 7? The answer is 19.",
    "Say hello to the world. hello world!",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "```python\nprint(1 + 2)\n```\n```output\n3\n```",
    "Question: repeat the word cat. Answer: cat",
]


def build_tokenizer(corpus: Iterable[str] = DEFAULT_CORPUS, vocab_size: int = 320):
    """A byte-level BPE tokenizer (left padding, chat template) as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                                           pad_token="<|pad|>", padding_side="left")
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    return hf_tokenizer


def build_random_model(out_dir: str | os.PathLike, *, tokenizer=None, hidden: int = 64, layers: int = 2,
                       heads: int = 4, max_positions: int = 512, seed: int = 0, tied: bool = False) -> Path:
    """Save a randomly initialised Llama model and its tokenizer to ``out_dir``; return the path.
    ``tied``: the output layer shares the input embedding's weights (as Qwen2.5-0.5B's does)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = tokenizer or build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out



_CACHED: Path | None = None


def cached_tiny_model() -> Path:
    """One tiny model per process, in a temporary folder removed at exit."""
    global _CACHED
    if _CACHED is None:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="rlhf-tiny-model-")
        atexit.register(shutil.rmtree, folder, True)
        _CACHED = build_random_model(Path(folder) / "model")
    return _CACHED
