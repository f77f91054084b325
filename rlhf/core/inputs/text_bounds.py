"""Cut text before it is tokenised: a prompt of 100 MB once cost the tokenizer 3 GB (and a Rust
allocation abort) before its tokens were cut to ``--max-prompt-length``.

A text of ``n`` tokens has at most ``n * L`` characters, ``L`` the longest token of the
tokenizer's vocabulary (`longest_token_chars`; a byte-level BPE token's string has one character
per byte, and a text at most one character per byte; SentencePiece's and WordPiece's strings are
no shorter than the text they stand for). So of a text longer than `char_bound` characters the
tokenizer keeps at most the last (or first) `char_bound` anyway: the rest is cut off first, with
`MARGIN_TOKENS` to spare so that the tokens at the cut do not reach the ones kept. (A WordPiece
``[UNK]`` standing for a long unknown word is the exception; such tokenizers do not train causal
language models.)
"""

from __future__ import annotations

import weakref
from typing import Any

MARGIN_TOKENS = 64  # tokens beyond the budget kept before the tokenizer cuts

_longest: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int:
    """The characters of the tokenizer's longest token (its added tokens included), at least 1."""
    try:
        return _longest[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: a generous bound
        longest = 64
    longest = max(int(longest), 1)
    try:
        _longest[tokenizer] = longest
    except TypeError:
        pass
    return longest


def char_bound(tokenizer: Any, tokens: int) -> int:
    """The characters beyond which a text has more than ``tokens`` tokens (plus the margin)."""
    return (max(int(tokens), 0) + MARGIN_TOKENS) * longest_token_chars(tokenizer)


def keep_end(text: str, tokenizer: Any, tokens: int) -> tuple[str, bool]:
    """``text`` cut to its last `char_bound` characters (a prompt loses its start), and whether it was cut."""
    bound = char_bound(tokenizer, tokens)
    return (text[-bound:], True) if len(text) > bound else (text, False)


def keep_start(text: str, tokenizer: Any, tokens: int) -> tuple[str, bool]:
    """``text`` cut to its first `char_bound` characters (a response loses its end), and whether it was cut."""
    bound = char_bound(tokenizer, tokens)
    return (text[:bound], True) if len(text) > bound else (text, False)
