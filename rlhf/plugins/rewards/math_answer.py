"""``boxed_math``: the last ``\\boxed{...}`` answer of a completion against the label, with numbers
compared by value.

Equal after normalisation when the strings match, or when both read as the same rational number:
``0.50`` == ``1/2`` == ``.5`` == ``\\frac{1}{2}`` == ``\\dfrac12``; ``1,000`` == ``1000``; a trailing
unit (``5 cm``, ``5\\text{ cm}``), ``\\$``, ``\\%`` and degrees are optional; ``x = 3`` == ``3``.
A decimal equals a fraction only when it is exactly that fraction (``0.33`` is not ``1/3``).

What this checker decides stays decided: equal strings, and two numbers (equal by value or not).
The rest, where symbolic algebra is needed (``\\sqrt{8}`` and ``2\\sqrt{2}``, ``\\frac{\\pi}{2}`` and
``\\pi/2``), goes to Hugging Face's ``math-verify`` when it is installed (``pip install
"rlhf-core[math]"``), with its 5-second limits in the main thread (they use SIGALRM, which other
threads cannot); without it, such answers are unequal.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_FRACTION = re.compile(rf"^([+-]?)\(?({_NUMBER})\)?/\(?({_NUMBER})\)?$")
_FRAC_COMMAND = re.compile(r"\\[dt]?frac")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_UNIT = re.compile(rf"^({_NUMBER}(?:/{_NUMBER})?)\s+[a-zA-Z][a-zA-Z.\s]*(?:\^?\{{?\d\}}?)?$")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\w*\s*=\s*(.+)$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    rest = text[i:].lstrip(" ")
    if rest.startswith("{"):
        group = _group(rest, 0)
        return group[0] if group else None  # None: unbalanced braces
    match = re.match(r"[^\s$]+", rest)
    return match.group(0) if match else None


def _group(text: str, i: int) -> tuple[str, int] | None:
    """The argument of a LaTeX command at ``text[i]``: a balanced ``{...}`` or one character."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        return text[i], i + 1
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j], j + 1
    return None


def _expand_fractions(s: str) -> str:
    """``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac``, ``\\frac12``, nested) -> ``(a)/(b)``."""
    while match := _FRAC_COMMAND.search(s):
        top = _group(s, match.end())
        bottom = _group(s, top[1]) if top else None
        if top is None or bottom is None:
            return s
        s = f"{s[:match.start()]}({top[0]})/({bottom[0]}){s[bottom[1]:]}"
    return s


def normalize_answer(answer: str) -> str:
    """A canonical string form: LaTeX spacing, wrappers, units and separators removed."""
    s = answer.strip().replace("\u2212", "-")
    s = s.strip("$").strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2]
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\displaystyle"):
        s = s.replace(token, " " if token in ("\\ ", "~") else "")
    for token in ("^\\circ", "^{\\circ}", "\u00b0", "\\%", "%", "\\$", "$"):
        s = s.replace(token, "")
    while (new := _TEXT.sub(r" \1", s)) != s:
        s = new
    s = _THOUSANDS.sub("", s.strip())
    if match := _ASSIGNMENT.match(s):
        s = match.group(1)
    if match := _UNIT.match(s.strip()):
        s = match.group(1)
    s = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)
    s = _expand_fractions(s)
    return re.sub(r"\s+", "", s).rstrip(".")


def as_number(normalized: str) -> Fraction | None:
    """The exact value of a normalised answer that is a number or a fraction of two numbers."""
    try:
        if re.fullmatch(_NUMBER, normalized):
            return Fraction(normalized)
        if match := _FRACTION.match(normalized):
            sign, top, bottom = match.groups()
            value = Fraction(top) / Fraction(bottom)
            return -value if sign == "-" else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_equal(predicted: str, expected: str) -> bool:
    a, b = normalize_answer(predicted), normalize_answer(expected)
    if a == b:
        return bool(a)
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y
    return bool(a and b) and symbolically_equal(predicted, expected) is True


def symbolically_equal(predicted: str, expected: str) -> bool | None:
    """``math-verify``'s verdict on two LaTeX answers; None when it is not installed or parses neither."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold, target = parse(f"${expected}$", parsing_timeout=limit), parse(f"${predicted}$", parsing_timeout=limit)
    if not gold or not target:
        return None
    return bool(verify(gold, target, timeout_seconds=limit))


def text_of(completion: Any) -> str:
    """A completion's text, whether it is a string or chat messages (TRL's conversational form)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def boxed_math(completions: list[Any], labels: list[Any]) -> list[float | None]:
    """1.0 when the last \\boxed{} answer equals the label (numbers compared by value), else 0.0."""
    rewards: list[float | None] = []
    for completion, label in zip(completions, labels):
        if label is None:
            rewards.append(None)
            continue
        expected = str(label)
        expected = last_boxed(expected) or expected
        predicted = last_boxed(text_of(completion))
        rewards.append(float(predicted is not None and answers_equal(predicted, expected)))
    return rewards
