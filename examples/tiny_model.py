"""Build tiny Llama models with a byte-level BPE tokenizer, fully offline.

Used by the tests (random weights, seconds to build) and by ``examples/make_quickstart_model.py``
(which then warms the model up on the toy task). The tokenizer is trained with the ``tokenizers``
library on a small corpus; the config is a ``LlamaConfig`` because ``AutoTokenizer`` keeps our
tokenizer for it (a Qwen2 config makes it swap in a different one).

    python examples/tiny_model.py OUT_DIR [--hidden 64] [--layers 2]
"""

from __future__ import annotations

import argparse

from rlhf.plugin_kit.tiny_model import CHAT_TEMPLATE, DEFAULT_CORPUS, SPECIAL_TOKENS, build_random_model, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "DEFAULT_CORPUS", "SPECIAL_TOKENS", "build_random_model", "build_tokenizer"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(build_random_model(args.out_dir, hidden=args.hidden, layers=args.layers))
