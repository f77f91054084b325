"""The registered rule-based rewards, through the same path `rlhf train --reward NAME` uses."""

from __future__ import annotations

import pytest

from rlhf.plugins.rewards.builtin import exact_match_reward, regex_reward
from rlhf.plugins.rewards.math_answer import answers_equal, last_boxed
from rlhf.rewards import load_reward

pytestmark = pytest.mark.unit


def score(plugins, name, completions, labels=None, **columns):
    return load_reward(name, plugins=plugins).score(["p"] * len(completions), completions, labels, **columns)


def test_builtins_are_registered(plugins):
    registry = plugins.registry("reward")
    for name in ("exact_match", "regex_match", "think_format", "boxed_math"):
        component = registry.component(name)
        assert component.provider.name == "rlhf.plugins.rewards.plugin"
        assert component.description


def test_exact_match_strips_and_skips_missing_labels(plugins):
    assert score(plugins, "exact_match", [" 42\n", "42.0", "x"], ["42", "42", None]) == [1.0, 0.0, None]


def test_exact_match_with_extraction_and_chat_completions():
    reward = exact_match_reward(r"Answer:\s*(\S+)", ignore_case=True)
    chat = [{"role": "assistant", "content": "Think... Answer: Paris"}]
    assert reward([chat, "Answer: Rome. Answer: LYON", "no answer"], ["paris", "lyon", "x"]) == [1.0, 1.0, 0.0]
    assert reward.__name__ == "exact_match"


def test_regex_match_reads_the_label_as_a_pattern(plugins):
    values = score(plugins, "regex_match", ["abc123", "abc", "  x\ny  "], [r"[a-z]+\d+", r"[a-z]+\d+", "x.y"])
    assert values == [1.0, 0.0, 1.0]


def test_a_bad_pattern_fails_only_its_sample(plugins):
    values = load_reward("regex_match", plugins=plugins, on_error="skip").score(["p", "p"], ["a", "a"], ["(", "a"])
    assert values == [None, 1.0]


def test_think_format(plugins):
    values = score(plugins, "think_format", ["<think>plan</think> 42", "<think>plan</think>", "42",
                                              "<think>a<think>b</think> 4"])
    assert values == [1.0, 0.0, 0.0, 0.0]
    assert regex_reward(r"\d+")(["12", "a1"]) == [1.0, 0.0]


def test_boxed_math_compares_numbers_by_value(plugins):
    completions = [r"so \boxed{0.50}", r"\boxed{\frac{1}{2}}", r"\boxed{.5}", r"\boxed{1,000}",
                   r"\boxed{5 \text{ cm}}", r"no box 0.5", r"\boxed{0.49}", r"first \boxed{1} then \boxed{2}"]
    labels = ["1/2", "0.5", r"\boxed{\dfrac12}", "1000", "5", "0.5", "1/2", "2"]
    assert score(plugins, "boxed_math", completions, labels) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("a, b, equal", [
    ("x = 3", "3", True), (r"50\%", "50", True), (r"90^\circ", "90", True), (r"\$5", "5", True),
    ("(1,2)", "(1, 2)", True), ("-0.5", r"-\frac{1}{2}", True), ("1e3", "1000", True),
    ("5x", "5", False), ("0.33", "1/3", False), ("1,2", "12", False), ("", "", False),
])
def test_answer_normalisation(a, b, equal):
    assert answers_equal(a, b) is equal


def test_last_boxed_handles_nesting_and_missing_braces():
    assert last_boxed(r"\boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert last_boxed(r"\boxed 7$") == "7"
    assert last_boxed(r"\boxed{open") is None
    assert last_boxed("none") is None


@pytest.mark.parametrize("a, b, equal", [
    (r"2\sqrt{2}", r"\sqrt{8}", True), (r"\frac{\pi}{2}", r"\pi/2", True), (r"x^2+2x+1", r"(x+1)^2", True),
    (r"\sqrt{2}", r"\sqrt{3}", False), (r"\sqrt{4}", "2", True), (r"\frac{\pi}{2}", r"\pi", False),
])
def test_symbolic_answers_are_settled_by_math_verify(a, b, equal):
    pytest.importorskip("math_verify", reason="the math extra is not installed")
    assert answers_equal(a, b) is equal


def test_math_verify_never_overturns_what_the_plain_checker_decides(monkeypatch):
    """Equal strings and two numbers are decided without it: the same verdicts with a math-verify
    that would say the opposite."""
    from rlhf.plugins.rewards import math_answer

    decided = [("0.50", "1/2", True), ("0.33", "1/3", False), ("1e3", "1000", True), ("0.49", "1/2", False),
               (r"\sqrt{8}", r"\sqrt{8}", True)]
    monkeypatch.setattr(math_answer, "symbolically_equal", lambda predicted, expected: True)
    assert [answers_equal(a, b) for a, b, _ in decided] == [equal for _, _, equal in decided]
    monkeypatch.setattr(math_answer, "symbolically_equal", lambda predicted, expected: None)  # not installed
    assert answers_equal(r"2\sqrt{2}", r"\sqrt{8}") is False


def test_math_verify_runs_in_a_worker_thread(plugins):
    """Reward sources may score in threads, where math-verify's SIGALRM limits cannot be set."""
    import concurrent.futures

    pytest.importorskip("math_verify", reason="the math extra is not installed")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(answers_equal, r"2\sqrt{2}", r"\sqrt{8}").result() is True
    assert score(plugins, "boxed_math", [r"\boxed{2\sqrt{2}}", r"\boxed{3}"], [r"\sqrt{8}", r"\sqrt{8}"]) == [1.0, 0.0]
