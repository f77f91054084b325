"""A text longer than the reward model's limit keeps the token its score is read at.

* Scoring (rlhf/rewards/reward_model.py, ``--reward-rm-max-length``): the end of the text is kept
  (and the EOS appended after it), so the score is the value at the text's real last token, as a
  forward over its last ``max_length`` tokens gives it, alone or in a padded batch;
* training (the ``rm`` objective, ``--max-len``): the sequence is cut to the limit with EOS last,
  and the score is read at that EOS, the row's last real token, whatever the padding of the batch.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.rewards.options import RewardOptions
from rlhf.rewards.reward_model import RewardModelWorker
from tests.models import checkpoints
from tests.models.checkpoints import save_openrlhf_layout

pytestmark = pytest.mark.unit

LONG = "the quick brown fox jumps over the lazy dog and then runs far away into the woods " * 3
SHORT = "cat"


@pytest.fixture(scope="module")
def tokenizer():
    return checkpoints.tokenizer()


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tokenizer):
    return save_openrlhf_layout(tmp_path_factory.mktemp("rm-truncation"), tokenizer, "score")


def value_at_last(rm_dir, ids):
    """The head's value at the last of ``ids`` (one unpadded forward)."""
    from safetensors.torch import load_file
    from transformers import LlamaModel

    base = LlamaModel.from_pretrained(rm_dir)
    weight = load_file(str(rm_dir / "model.safetensors"))["score.weight"]
    with torch.no_grad():
        hidden = base(input_ids=torch.tensor([ids])).last_hidden_state  # (1, T, H)
    return float(hidden[0, -1] @ weight[0])


@pytest.mark.parametrize("append_eos", [False, True])
def test_a_long_text_is_scored_at_its_last_token(rm_dir, tokenizer, append_eos):
    limit = 16
    ids = tokenizer(LONG, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if append_eos else [])
    assert len(ids) > 3 * limit
    options = RewardOptions(rm_max_length=limit, rm_append_eos=append_eos, rm_batch_size=2)
    alone = RewardModelWorker(rm_dir, options).score([LONG])[0]
    tail, head = value_at_last(rm_dir, ids[-limit:]), value_at_last(rm_dir, ids[:limit])
    assert alone == pytest.approx(tail, abs=1e-5)
    assert alone != pytest.approx(head, abs=1e-3)  # the start of the text would be another score
    batched = RewardModelWorker(rm_dir, options).score([SHORT, LONG])  # padded to the long one's length
    assert batched[1] == pytest.approx(tail, abs=1e-5)
    short_ids = tokenizer(SHORT, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if append_eos
                                                                          else [])
    assert batched[0] == pytest.approx(value_at_last(rm_dir, short_ids), abs=1e-5)


def test_without_a_limit_the_whole_text_is_scored(rm_dir, tokenizer):
    ids = tokenizer(LONG, add_special_tokens=False)["input_ids"]
    assert RewardModelWorker(rm_dir).score([LONG])[0] == pytest.approx(value_at_last(rm_dir, ids), abs=1e-5)


def test_the_rm_objective_cuts_at_max_len_and_reads_the_score_at_the_eos(tokenizer):
    from transformers import LlamaForSequenceClassification

    from rlhf.core.protocols.objective import FitModels
    from rlhf.plugins.objectives.config import RewardModelConfig
    from rlhf.plugins.objectives.reward_model import RewardModelObjective
    from rlhf.runtime.fit.text import TextFormatter

    torch.manual_seed(0)
    classifier = LlamaForSequenceClassification(checkpoints.llama_config(tokenizer, num_labels=1)).eval()
    with torch.no_grad():
        classifier.score.weight.normal_(0, 1)

    def values(input_ids, attention_mask):  # a value per position (B, T), as `rlhf rm`'s model returns them
        hidden = classifier.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return classifier.score(hidden).squeeze(-1)

    objective = RewardModelObjective(RewardModelConfig())
    limit = 12
    chosen, rejected, _ = objective.encode({"prompt": "Q: ", "chosen": LONG, "rejected": SHORT},
                                           TextFormatter(tokenizer, max_len=limit))
    assert len(chosen) == limit and chosen[-1] == tokenizer.eos_token_id  # cut, EOS last
    assert chosen[:-1] == tokenizer("Q: " + LONG, add_special_tokens=False)["input_ids"][:limit - 1]
    assert rejected[-1] == tokenizer.eos_token_id and len(rejected) < limit
    batch = objective.collate([(chosen, rejected, 0.0)], tokenizer.pad_token_id)  # the rejected row padded
    with torch.no_grad():
        got_chosen, got_rejected = objective.scores(FitModels(model=values), batch)
        expected = [float(values(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0, -1])
                    for ids in (chosen, rejected)]
    assert [float(got_chosen[0]), float(got_rejected[0])] == pytest.approx(expected, abs=1e-5)
