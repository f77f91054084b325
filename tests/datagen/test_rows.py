"""The output rows of each mode, on hand-written rewards (ties, abstentions, chat prompts)."""

from __future__ import annotations

from collections import Counter

import pytest

from rlhf.core.errors import ConfigError
from rlhf.datagen.config import GenerateConfig
from rlhf.datagen.rows import Sample, Selection, make_rows, with_score

pytestmark = pytest.mark.unit

SAMPLE = Sample(prompt="2+2=", completions=["a", "b", "c", "d"], rewards=[0.5, 2.0, None, 2.0], label="4",
                columns={"answer": "4", "id": 7}, index=3)


def rows(mode: str, sample: Sample = SAMPLE, **selection) -> tuple[list[dict], Counter]:
    skipped: Counter = Counter()
    return make_rows(sample, Selection(mode=mode, **selection), skipped), skipped


def test_samples_rows_keep_every_completion_reward_and_column():
    assert rows("samples", has_label=True)[0] == [{"prompt": "2+2=", "completions": ["a", "b", "c", "d"],
                                                   "rewards": [0.5, 2.0, None, 2.0], "label": "4", "answer": "4",
                                                   "id": 7}]
    unscored = Sample(prompt="p", completions=["x"], rewards=None, columns={"prompt": "other", "k": 1})
    assert rows("samples", unscored)[0] == [{"prompt": "p", "completions": ["x"], "k": 1}]


def test_best_of_n_and_pairs_take_the_first_of_equal_rewards_and_ignore_abstentions():
    assert rows("best_of_n")[0] == [{"prompt": "2+2=", "response": "b", "reward": 2.0}]
    assert rows("pairs")[0] == [{"prompt": "2+2=", "chosen": "b", "rejected": "a", "chosen_reward": 2.0,
                                 "rejected_reward": 0.5}]


def test_ties_and_unscored_prompts_are_skipped_and_counted():
    tie = Sample(prompt="p", completions=["x", "y"], rewards=[1.0, 1.0])
    none = Sample(prompt="q", completions=["x", "y"], rewards=[None, None])
    assert rows("pairs", tie) == ([], Counter(ties=1))
    assert rows("pairs", none) == ([], Counter(unscored=1))
    assert rows("best_of_n", none) == ([], Counter(unscored=1))
    assert rows("best_of_n", tie)[0] == [{"prompt": "p", "response": "x", "reward": 1.0}]


def test_conditional_rows_carry_the_score_in_the_prompt():
    every = rows("conditional", conditional_rows="sample")[0]
    assert every == [{"prompt": "2+2= <rm_score>: 0.50 ", "response": "a", "reward": 0.5},
                     {"prompt": "2+2= <rm_score>: 2.00 ", "response": "b", "reward": 2.0},
                     {"prompt": "2+2= <rm_score>: 2.00 ", "response": "d", "reward": 2.0}]
    one = rows("conditional", seed=1)[0]
    assert len(one) == 1 and one[0] in every
    assert rows("conditional", seed=1)[0] == one  # seeded by the seed and the prompt's position
    picks = {rows("conditional", seed=s)[0][0]["response"] for s in range(40)}
    assert picks == {"a", "b", "d"}  # drawn among the scored samples


def test_a_chat_prompt_gets_the_template_in_its_last_user_message():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
    scored = with_score(chat, 3.14159, "[{reward}] {input}")
    assert scored[:3] == chat[:3] and scored[3] == {"role": "user", "content": "[3.14] 2+2?"}
    assert chat[3]["content"] == "2+2?"  # the input is not modified


def test_config_checks_modes_before_anything_loads():
    base = {"model": "m", "data": ["d.jsonl"], "out": "o.jsonl"}
    assert GenerateConfig(**base).check() == "samples"
    assert GenerateConfig(**base, reward=["r.py"], conditional=True).check() == "conditional"
    for bad, message in (({"pairs": True}, "add --reward"), ({"reward": ["r"], "pairs": True, "n": 1}, "--n 2"),
                         ({"reward": ["r"], "conditional": True, "reward_template": "{input}"}, "{reward}"),
                         ({"n": 0}, "--n must be at least 1"), ({"top_p": 0.0}, "--top-p")):
        with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}").replace("-", r"\-")):
            GenerateConfig(**{**base, **bad}).check()
