"""Reward models on tiny random Llamas, in both checkpoint layouts: scores equal a manual forward
pass read at the last real token, whatever the padding."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from rlhf.rewards.options import RewardOptions
from rlhf.rewards.reward_model import RewardModelSource, RewardModelWorker
from rlhf.rewards import RewardConfigError, load_reward
from tests.models import checkpoints
from tests.models.checkpoints import llama_config, save_openrlhf_layout

pytestmark = pytest.mark.unit

PROMPTS = ["What is 12 + 7?", "Say hello to the world."]
COMPLETIONS = [" The answer is 19.", " hello"]


@pytest.fixture(scope="module")
def tokenizer():
    return checkpoints.tokenizer()


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tokenizer):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1))
    out = tmp_path_factory.mktemp("rm-classifier")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def openrlhf_dir(tmp_path_factory, tokenizer):
    return save_openrlhf_layout(tmp_path_factory.mktemp("rm-openrlhf"), tokenizer, "score", in_config=False)


def manual_scores(base: nn.Module, weight: torch.Tensor, tokenizer, texts: list[str]) -> list[float]:
    """One unpadded forward per text; the head applied to the last hidden state."""
    scores = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]  # (1, T)
        with torch.no_grad():
            hidden = base(input_ids=ids).last_hidden_state  # (1, T, H)
        scores.append(float(hidden[0, -1] @ weight[0].detach()))
    return scores


def test_sequence_classification_layout(classifier_dir, tokenizer, plugins):
    from transformers import LlamaForSequenceClassification

    source = load_reward(str(classifier_dir), plugins=plugins, rm_batch_size=2)
    assert isinstance(source, RewardModelSource) and source.name == classifier_dir.name
    got = source.score(PROMPTS, COMPLETIONS)
    reference = LlamaForSequenceClassification.from_pretrained(classifier_dir)
    expected = manual_scores(reference.model, reference.score.weight, tokenizer,
                             [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert got == pytest.approx(expected, abs=1e-5)
    assert got[0] != pytest.approx(got[1], abs=1e-3)  # the two texts really differ


def test_openrlhf_layout_with_default_prefix(openrlhf_dir, tokenizer):
    from safetensors.torch import load_file
    from transformers import LlamaModel

    worker = RewardModelWorker(openrlhf_dir, RewardOptions(rm_batch_size=4))
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)] + ["hello"]
    base = LlamaModel.from_pretrained(openrlhf_dir)
    weight = load_file(str(openrlhf_dir / "model.safetensors"))["score.weight"]
    assert worker.score(texts) == pytest.approx(manual_scores(base, weight, tokenizer, texts), abs=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_side_does_not_change_scores(openrlhf_dir, side):
    worker = RewardModelWorker(openrlhf_dir, RewardOptions(rm_batch_size=1))
    texts = ["hello", "The quick brown fox jumps over the lazy dog", "cat"]
    alone = worker.score(texts)
    worker.options = RewardOptions(rm_batch_size=3)
    worker.tokenizer.padding_side = side
    assert worker.score(texts) == pytest.approx(alone, abs=1e-5)


def test_custom_prefix_from_option_or_config(tmp_path, tokenizer):
    by_option = save_openrlhf_layout(tmp_path / "a", tokenizer, "value_head", in_config=False)
    by_config = save_openrlhf_layout(tmp_path / "b", tokenizer, "value_head", in_config=True)
    texts = ["hello world"]
    with pytest.raises(RewardConfigError, match=r"no weight 'score.weight'.*value_head.weight"):
        RewardModelWorker(by_option).score(texts)
    a = RewardModelWorker(by_option, RewardOptions(value_head_prefix="value_head")).score(texts)
    b = RewardModelWorker(by_config).score(texts)  # config.json's value_head_prefix wins over the default
    assert a == pytest.approx(b, abs=1e-6)


def test_normalize_with_config_mean_and_std(openrlhf_dir, tmp_path):
    import shutil

    normalized = tmp_path / "norm"
    shutil.copytree(openrlhf_dir, normalized)
    config = json.loads((normalized / "config.json").read_text())
    (normalized / "config.json").write_text(json.dumps({**config, "mean": 0.5, "std": 2.0}))
    raw = RewardModelWorker(openrlhf_dir).score(["hello"])[0]
    scaled = RewardModelWorker(normalized, RewardOptions(rm_normalize=True)).score(["hello"])[0]
    assert scaled == pytest.approx((raw - 0.5) / 2.0, abs=1e-6)
    with pytest.raises(RewardConfigError, match="no mean and std"):
        RewardModelWorker(openrlhf_dir, RewardOptions(rm_normalize=True)).score(["hello"])


def test_append_eos_changes_the_scored_token(openrlhf_dir, tokenizer):
    plain = RewardModelWorker(openrlhf_dir).score(["hello"])[0]
    with_eos = RewardModelWorker(openrlhf_dir, RewardOptions(rm_append_eos=True)).score(["hello"])[0]
    explicit = RewardModelWorker(openrlhf_dir).score(["hello" + tokenizer.eos_token])[0]
    assert with_eos == pytest.approx(explicit, abs=1e-6) and with_eos != pytest.approx(plain, abs=1e-4)


def test_two_label_classifier_is_refused(tmp_path, tokenizer):
    from transformers import LlamaForSequenceClassification

    LlamaForSequenceClassification(llama_config(tokenizer, num_labels=2)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(RewardConfigError, match="2 labels"):
        RewardModelWorker(tmp_path).score(["x"])


def test_model_failure_follows_the_policy(openrlhf_dir):
    class Broken:
        def score(self, texts):
            raise RuntimeError("CUDA out of memory")

    source = RewardModelSource(openrlhf_dir, "rm", RewardOptions(on_error="skip"), worker=Broken())
    assert source.score(["p", "p"], ["a", "b"]) == [None, None]


@pytest.mark.parametrize("layout", ["classifier", "openrlhf"])
def test_a_damaged_reward_model_is_one_line_naming_it(layout, classifier_dir, openrlhf_dir, tmp_path, plugins):
    import shutil

    from rlhf.core.errors import RlhfError

    damaged = tmp_path / "damaged-rm"
    shutil.copytree(classifier_dir if layout == "classifier" else openrlhf_dir, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(RlhfError, match=f"cannot read the weights of {damaged}: a file there is damaged or incomplete"):
        load_reward(str(damaged), plugins=plugins, rm_batch_size=2).score(PROMPTS, COMPLETIONS)
