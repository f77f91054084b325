"""Each built-in objective's encoding of a hand-built row: the exact token ids and loss mask (prompt 0,
response and EOS 1), plain, with ``--input-template``, with ``--apply-chat-template`` (string and
message prompts, whole conversations) and with ``--multiturn``.

The expected sequences are written here as segments of text, each learnt or not; a segment's ids
are the tokenizer's ids of that text alone. Chat-template texts are spelled out (the tiny model's
template is ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, ``<|im_start|>assistant\\n`` as
the generation prompt), not produced by the code under test.
"""

from __future__ import annotations

import pytest

from rlhf.core.protocols.objective import SkipExample
from rlhf.plugins.objectives.config import (DistillConfig, DPOConfig, KTOConfig, PRMConfig, RewardModelConfig,
                                            SFTConfig)
from rlhf.plugins.objectives.distill import DistillObjective
from rlhf.plugins.objectives.dpo import DPOObjective
from rlhf.plugins.objectives.kto import KTOObjective
from rlhf.plugins.objectives.prm import PRMObjective
from rlhf.plugins.objectives.reward_model import RewardModelObjective
from rlhf.plugins.objectives.sft import SFTObjective
from rlhf.runtime.fit.text import TextFormatter

pytestmark = pytest.mark.unit

EOS = object()  # the tokenizer's EOS token, as a segment
GENERATION_PROMPT = "<|im_start|>assistant\n"


def turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def formatter(tokenizer, **options) -> TextFormatter:
    return TextFormatter(tokenizer, **options)


def sequence(tokenizer, *segments: tuple[object, int]) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of ``(text or EOS, learnt)`` segments, each text tokenized on its own."""
    ids: list[int] = []
    mask: list[int] = []
    for text, learnt in segments:
        piece = [tokenizer.eos_token_id] if text is EOS else tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [learnt] * len(piece)
    return ids, mask


# --- sft and distill ------------------------------------------------------------------------------


SFT_CASES = {
    "plain": ({}, {}, {"prompt": "Q: 2 + 3?", "response": "5 it is"},
              [("Q: 2 + 3?", 0), ("5 it is", 1), (EOS, 1)]),
    "trailing newlines dropped": ({}, {}, {"prompt": "Q: hi?", "response": "hello\n\n"},
                                  [("Q: hi?", 0), ("hello", 1), (EOS, 1)]),
    "input template": ({"input_template": "User: {} Assistant:"}, {}, {"prompt": "Q: hi?", "response": "hello"},
                       [("User: Q: hi? Assistant:", 0), ("hello", 1), (EOS, 1)]),
    "chat template, string prompt": (
        {"apply_chat_template": True}, {}, {"prompt": "Q: hi?", "response": "hello world"},
        [(turn("user", "Q: hi?") + GENERATION_PROMPT, 0), ("hello world<|im_end|>", 1), (EOS, 1)]),
    "chat template, message prompt": (
        {"apply_chat_template": True}, {},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: hi?"}],
         "response": "hello"},
        [(turn("system", "be brief") + turn("user", "Q: hi?") + GENERATION_PROMPT, 0), ("hello<|im_end|>", 1),
         (EOS, 1)]),
    "chat template, whole conversation": (
        {"apply_chat_template": True}, {"output_key": None},
        {"prompt": [{"role": "user", "content": "Q: hi?"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "Q: 2 + 3?"}, {"role": "assistant", "content": "5"}]},
        [(turn("user", "Q: hi?") + turn("assistant", "hello") + turn("user", "Q: 2 + 3?") + GENERATION_PROMPT, 0),
         ("5<|im_end|>", 1), (EOS, 1)]),
    "multiturn": (
        {"apply_chat_template": True}, {"output_key": None, "multiturn": True},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: hi?"},
                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "Q: 2 + 3?"},
                    {"role": "assistant", "content": "5"}]},
        [(turn("system", "be brief") + turn("user", "Q: hi?") + GENERATION_PROMPT, 0), ("hello<|im_end|>\n", 1),
         (turn("user", "Q: 2 + 3?") + GENERATION_PROMPT, 0), ("5<|im_end|>", 1), (EOS, 1)]),
    "multiturn, response column": (
        {"apply_chat_template": True}, {"multiturn": True},
        {"prompt": [{"role": "user", "content": "Q: hi?"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "Q: 2 + 3?"}],
         "response": {"role": "assistant", "content": "5"}},
        [(turn("user", "Q: hi?") + GENERATION_PROMPT, 0), ("hello<|im_end|>\n", 1),
         (turn("user", "Q: 2 + 3?") + GENERATION_PROMPT, 0), ("5<|im_end|>", 1), (EOS, 1)]),
    "pretrain mode": ({}, {"pretrain_mode": True}, {"prompt": "the quick brown fox"},
                      [("the quick brown fox", 1)]),
}


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_learns_exactly_the_response_and_its_eos(case, tokenizer):
    text_options, settings, row, segments = SFT_CASES[case]
    objective = SFTObjective(SFTConfig(**settings))
    assert objective.encode(row, formatter(tokenizer, **text_options)) == sequence(tokenizer, *segments)


@pytest.mark.parametrize("case", ["plain", "chat template, string prompt", "chat template, whole conversation"])
def test_distill_encodes_as_sft(case, tokenizer):
    text_options, settings, row, segments = SFT_CASES[case]
    objective = DistillObjective(DistillConfig(**{k: v for k, v in settings.items() if k == "output_key"}))
    assert objective.encode(row, formatter(tokenizer, **text_options)) == sequence(tokenizer, *segments)


def test_an_overlong_response_loses_its_end_and_keeps_its_eos(tokenizer):
    prompt, response = sequence(tokenizer, ("Q: 2 + 3?", 0))[0], sequence(tokenizer, ("the quick brown fox", 1))[0]
    max_len = len(prompt) + 3
    ids, mask = SFTObjective().encode({"prompt": "Q: 2 + 3?", "response": "the quick brown fox"},
                                      formatter(tokenizer, max_len=max_len))
    assert ids == prompt + response[:2] + [tokenizer.eos_token_id]
    assert mask == [0] * len(prompt) + [1, 1, 1]
    with pytest.raises(SkipExample, match="no room for a response"):
        SFTObjective().encode({"prompt": "Q: 2 + 3?", "response": "5"}, formatter(tokenizer, max_len=len(prompt) + 1))


# --- pairs: dpo and rm ----------------------------------------------------------------------------


def test_dpo_learns_each_response_and_its_eos_after_the_shared_prompt(tokenizer):
    row = {"prompt": "Q: hi?", "chosen": "hello", "rejected": "go away"}
    chosen, rejected = DPOObjective(DPOConfig()).encode(row, formatter(tokenizer))
    assert chosen == sequence(tokenizer, ("Q: hi?", 0), ("hello", 1), (EOS, 1))
    assert rejected == sequence(tokenizer, ("Q: hi?", 0), ("go away", 1), (EOS, 1))
    chosen, rejected = DPOObjective(DPOConfig()).encode(row, formatter(tokenizer, apply_chat_template=True))
    prompt = turn("user", "Q: hi?") + GENERATION_PROMPT
    assert chosen == sequence(tokenizer, (prompt, 0), ("hello<|im_end|>", 1), (EOS, 1))
    assert rejected == sequence(tokenizer, (prompt, 0), ("go away<|im_end|>", 1), (EOS, 1))


def test_dpo_pairs_of_whole_conversations_share_every_message_but_the_last(tokenizer):
    asked = [{"role": "user", "content": "Q: hi?"}]
    row = {"chosen": asked + [{"role": "assistant", "content": "hello"}],
           "rejected": asked + [{"role": "assistant", "content": "go away"}]}
    chosen, rejected = DPOObjective(DPOConfig()).encode(row, formatter(tokenizer, apply_chat_template=True))
    prompt = turn("user", "Q: hi?") + GENERATION_PROMPT
    assert chosen == sequence(tokenizer, (prompt, 0), ("hello<|im_end|>", 1), (EOS, 1))
    assert rejected == sequence(tokenizer, (prompt, 0), ("go away<|im_end|>", 1), (EOS, 1))


def test_rm_scores_the_whole_text_with_eos_appended(tokenizer):
    row = {"prompt": "Q: hi?", "chosen": "hello", "rejected": "go away", "margin": 0.5}
    objective = RewardModelObjective(RewardModelConfig(margin_key="margin"))
    chosen, rejected, margin = objective.encode(row, formatter(tokenizer))
    assert chosen == sequence(tokenizer, ("Q: hi?hello", 1), (EOS, 1))[0]
    assert rejected == sequence(tokenizer, ("Q: hi?go away", 1), (EOS, 1))[0]
    assert margin == 0.5
    chosen, rejected, _ = objective.encode(row, formatter(tokenizer, apply_chat_template=True))
    prompt = turn("user", "Q: hi?") + GENERATION_PROMPT
    assert chosen == sequence(tokenizer, (prompt + "hello<|im_end|>", 1), (EOS, 1))[0]
    assert rejected == sequence(tokenizer, (prompt + "go away<|im_end|>", 1), (EOS, 1))[0]


# --- kto ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
def test_kto_learns_the_completion_and_pairs_each_prompt_with_the_next_completion(chat, tokenizer):
    """Sample i's reference-point pair is its prompt + sample i+1's completion (the last wraps to the
    first), EOS included, cut to the longer of the two samples."""
    text = formatter(tokenizer, apply_chat_template=chat)
    rows = [{"prompt": "Q: hi?", "completion": "hello there world", "label": True},
            {"prompt": "Q: 2 + 3 + 4 + 5?", "completion": "14", "label": "false"},
            {"prompt": "Q: say hello?", "completion": "hello", "label": 1}]
    objective = KTOObjective(KTOConfig())
    examples = objective.step_examples([objective.encode(row, text) for row in rows])
    end = "<|im_end|>" if chat else ""
    prompts = [turn("user", row["prompt"]) + GENERATION_PROMPT if chat else row["prompt"] for row in rows]
    own = [sequence(tokenizer, (prompt, 0), (row["completion"] + end, 1), (EOS, 1)) for prompt, row in zip(prompts, rows)]
    for index, example in enumerate(examples):
        ids, mask = own[index]
        assert example.ids == ids and example.prompt_len == mask.index(1)  # learnt: everything after the prompt
        assert example.desirable is (index != 1)
        following = (index + 1) % len(rows)
        mismatched, _ = sequence(tokenizer, (prompts[index], 0), (rows[following]["completion"] + end, 1), (EOS, 1))
        assert example.kl_ids == mismatched[:max(len(ids), len(own[following][0]))]
    assert len(examples[2].kl_ids) < len(examples[2].prompt_ids) + own[0][1].count(1)  # the cut applies here


# --- prm ------------------------------------------------------------------------------------------


def test_prm_labels_exactly_the_placeholder_positions(tokenizer):
    objective = PRMObjective(PRMConfig(placeholder_token="@", reward_tokens=["+", "-"]))
    ids, labels = objective.encode({"input": "cat @ dog dog @", "label": ["-", "+"]}, formatter(tokenizer))
    expected_ids, _ = sequence(tokenizer, ("cat @ dog dog @", 0))
    assert ids == expected_ids
    at, plus, minus = (tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("@", "+", "-"))
    positions = [i for i, token in enumerate(ids) if token == at]
    assert len(positions) == 2
    assert labels == [minus if i == positions[0] else plus if i == positions[1] else -100 for i in range(len(ids))]
    _, soft = objective.encode({"input": "cat @ dog dog @", "label": [0.25, 1]}, formatter(tokenizer))
    assert soft == [0.25 if i == positions[0] else 1.0 if i == positions[1] else -100 for i in range(len(ids))]


# --- a tokenizer that adds BOS (as Llama's do) ------------------------------------------------------


@pytest.fixture(scope="module")
def bos_tokenizer(tiny_model_dir):
    """The tiny tokenizer, made to put BOS before every text it encodes with special tokens."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    assert tokenizer("Q: hi?")["input_ids"][0] == tokenizer.bos_token_id
    return tokenizer


def test_the_prompt_starts_with_bos_as_rlhf_train_feeds_it_and_nothing_else_gets_one(bos_tokenizer):
    bos = bos_tokenizer.bos_token_id
    ids, mask = SFTObjective().encode({"prompt": "Q: hi?", "response": "hello"}, formatter(bos_tokenizer))
    expected_ids, expected_mask = sequence(bos_tokenizer, ("Q: hi?", 0), ("hello", 1), (EOS, 1))
    assert (ids, mask) == ([bos] + expected_ids, [0] + expected_mask)
    chosen, _ = DPOObjective(DPOConfig()).encode({"prompt": "Q: hi?", "chosen": "hello", "rejected": "go away"},
                                                 formatter(bos_tokenizer))
    assert chosen == ([bos] + expected_ids, [0] + expected_mask)
    # under a chat template the template's text carries its own special tokens: no BOS is added
    ids, _ = SFTObjective().encode({"prompt": "Q: hi?", "response": "hello"},
                                   formatter(bos_tokenizer, apply_chat_template=True))
    assert bos not in ids


# --- lengths --------------------------------------------------------------------------------------


def test_a_prompt_two_tokens_short_of_max_len_keeps_one_response_token_and_eos(tokenizer):
    prompt = sequence(tokenizer, ("Q: 2 + 3?", 0))[0]
    response = sequence(tokenizer, ("the quick brown fox", 1))[0]
    ids, mask = SFTObjective().encode({"prompt": "Q: 2 + 3?", "response": "the quick brown fox"},
                                      formatter(tokenizer, max_len=len(prompt) + 2))
    assert ids == prompt + response[:1] + [tokenizer.eos_token_id] and mask == [0] * len(prompt) + [1, 1]
    with pytest.raises(SkipExample):
        SFTObjective().encode({"prompt": "Q: 2 + 3?", "response": "5"}, formatter(tokenizer, max_len=len(prompt) + 1))


def test_an_overlong_multiturn_conversation_is_cut_with_eos_last(tokenizer):
    text_options, settings, row, segments = SFT_CASES["multiturn"]
    full_ids, full_mask = sequence(tokenizer, *segments)
    max_len = len(full_ids) - 3
    ids, mask = SFTObjective(SFTConfig(**settings)).encode(row, formatter(tokenizer, max_len=max_len, **text_options))
    assert ids == full_ids[:max_len - 1] + [tokenizer.eos_token_id]
    assert mask == full_mask[:max_len]


def test_a_multiturn_conversation_ending_with_the_user_learns_no_eos(tokenizer):
    row = {"prompt": [{"role": "user", "content": "Q: hi?"}, {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "thanks"}]}
    ids, mask = SFTObjective(SFTConfig(output_key=None, multiturn=True)).encode(
        row, formatter(tokenizer, apply_chat_template=True))
    assert (ids, mask) == sequence(tokenizer, (turn("user", "Q: hi?") + GENERATION_PROMPT, 0),
                                   ("hello<|im_end|>\n", 1), (turn("user", "thanks").rstrip("\n"), 0), (EOS, 0))


def test_max_len_must_leave_room_for_a_prompt_a_response_and_eos(tokenizer):
    from rlhf.core.errors import ConfigError

    assert formatter(tokenizer, max_len=3).max_len == 3
    with pytest.raises(ConfigError, match="--max-len must leave room"):
        formatter(tokenizer, max_len=2)
