"""The critic: backbone + value head, initialised from a reward model in either layout or from the
policy, saved in OpenRLHF's layout so it loads back as a critic and as a reward model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from rlhf.core.errors import ConfigError
from rlhf.plugins.models.critic import CriticModel
from rlhf.plugins.models.hf import HFModelAdapter, HFModelConfig
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.reward_model import RewardModelWorker
from tests.models import checkpoints

REWARD = "def reward_func(completions):\n    return [len(c) / 10 for c in completions]\n"


@pytest.fixture(scope="module")
def tok():
    return checkpoints.tokenizer()


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tok):
    return checkpoints.save_classifier(tmp_path_factory.mktemp("rm-classifier"), tok)


@pytest.fixture(scope="module")
def openrlhf_dir(tmp_path_factory, tok):
    return checkpoints.save_openrlhf_layout(tmp_path_factory.mktemp("rm-openrlhf"), tok)


def load_critic(ref, **options) -> CriticModel:
    return HFModelAdapter(HFModelConfig(device="cpu", **options)).load(str(ref), role="critic")


def encode(tok, text="What is 12 + 7? The answer is 19."):
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]  # (1, T)
    return ids, torch.ones_like(ids)


@pytest.mark.unit
def test_critic_from_a_sequence_classification_reward_model(classifier_dir, tok):
    from transformers import LlamaForSequenceClassification

    critic = load_critic(classifier_dir)
    reward_model = LlamaForSequenceClassification.from_pretrained(classifier_dir)
    assert critic.initialised_from == "classifier"
    assert torch.equal(critic.head.weight, reward_model.score.weight)
    ids, mask = encode(tok)
    with torch.no_grad():
        values = critic(ids, mask)  # (1, T)
        expected = reward_model(input_ids=ids, attention_mask=mask).logits[0, 0]
    assert values.shape == ids.shape and values.dtype == torch.float32
    assert float(values[0, -1]) == pytest.approx(float(expected), abs=1e-5)  # V(last state) = the reward model's score


@pytest.mark.unit
@pytest.mark.parametrize("prefix, in_config, option", [
    ("score", False, "score"),  # OpenRLHF's default
    ("value_head", True, "score"),  # config.json's value_head_prefix wins over the option
    ("value_head", False, "value_head"),  # found through --value-head-prefix
])
def test_critic_from_an_openrlhf_reward_model(tmp_path, tok, prefix, in_config, option):
    path = checkpoints.save_openrlhf_layout(tmp_path / "rm", tok, prefix, in_config=in_config)
    critic = load_critic(path, value_head_prefix=option)
    assert critic.initialised_from == "base_and_head"
    worker = RewardModelWorker(path, RewardOptions(value_head_prefix=prefix))
    worker.load()
    assert torch.equal(critic.head.weight, worker.head.weight)
    ids, mask = encode(tok)
    with torch.no_grad():
        assert float(critic(ids, mask)[0, -1]) == pytest.approx(float(worker.forward(ids, mask)[0]), abs=1e-5)


@pytest.mark.unit
def test_critic_from_the_policy_gets_a_fresh_head_on_the_policy_backbone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    critic = load_critic(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert critic.initialised_from == "fresh"
    backbone = critic.backbone.state_dict()
    assert set(backbone) == {k.removeprefix("model.") for k in policy.state_dict() if k.startswith("model.")}
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(backbone[name], tensor), name
    hidden = policy.config.hidden_size
    assert critic.head.weight.shape == (1, hidden) and critic.head.bias is None
    assert 0 < float(critic.head.weight.detach().std()) < 3.0 / (hidden + 1)  # N(0, 1/(H+1)), as OpenRLHF draws it


@pytest.mark.unit
def test_a_classifier_with_several_labels_is_refused(tmp_path, tok):
    path = checkpoints.save_classifier(tmp_path / "clf", tok, num_labels=3)
    with pytest.raises(ConfigError, match="classifier with 3 labels"):
        load_critic(path)


@pytest.mark.unit
def test_a_declared_head_of_the_wrong_shape_is_refused(tmp_path, tok):
    path = checkpoints.save_openrlhf_layout(tmp_path / "rm", tok, "value_head", in_config=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "value_head_prefix": "missing_head"}))
    with pytest.raises(ConfigError, match="missing_head.weight is missing"):
        load_critic(path)


@pytest.mark.unit
def test_saved_critic_loads_back_as_a_critic_and_as_a_reward_model(openrlhf_dir, tok, tmp_path):
    adapter = HFModelAdapter(HFModelConfig(device="cpu", value_head_prefix="critic_head"))
    critic = adapter.load(str(openrlhf_dir), role="critic")
    with torch.no_grad():
        critic.head.weight.mul_(-2.0)  # differs from the reward model it came from
    assert hasattr(critic, "critic_head")
    adapter.save_critic(critic, tok, tmp_path / "critic")
    assert json.loads((tmp_path / "critic" / "config.json").read_text())["value_head_prefix"] == "critic_head"
    with safe_open(str(tmp_path / "critic" / "model.safetensors"), framework="pt") as handle:
        assert "critic_head.weight" in handle.keys()

    ids, mask = encode(tok)
    reloaded = load_critic(tmp_path / "critic")  # the declared prefix wins over the default "score"
    with torch.no_grad():
        expected = critic(ids, mask)
        assert torch.allclose(reloaded(ids, mask), expected, atol=1e-6)
    worker = RewardModelWorker(tmp_path / "critic")  # OpenRLHF's layout: a reward model too
    worker.load()
    with torch.no_grad():
        assert float(worker.forward(ids, mask)[0]) == pytest.approx(float(expected[0, -1]), abs=1e-5)


@pytest.mark.run
def test_lora_critic_trains_adapters_and_head_and_saves_them_merged(tiny_model_dir, tok, tmp_path):
    critic = load_critic(tiny_model_dir, lora_rank=4)
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or n.startswith("score.") for n in trainable)
    assert "score.weight" in trainable
    optimizer = torch.optim.SGD([p for p in critic.parameters() if p.requires_grad], lr=0.5)
    ids, mask = encode(tok)
    for _ in range(2):
        critic(ids, mask).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    critic.save_pretrained(tmp_path / "critic")
    with safe_open(str(tmp_path / "critic" / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    assert not any("lora_" in k or "base_layer" in k for k in keys) and "layers.0.self_attn.q_proj.weight" in keys
    reloaded = load_critic(tmp_path / "critic")
    with torch.no_grad():
        assert torch.allclose(reloaded(ids, mask), critic(ids, mask), atol=1e-5)


@pytest.mark.run
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_ppo_run_starts_the_critic_from_a_reward_model_and_saves_it(tiny_model_dir, classifier_dir, tmp_path,
                                                                     plugins, lora_rank):
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.rl.local import train

    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"What is {a} + 2?"}) + "\n" for a in range(4)))
    (tmp_path / "rewards.py").write_text(REWARD)
    out = tmp_path / "run"
    train(TrainConfig.from_dict(dict(
        model=str(tiny_model_dir), data=[str(tmp_path / "data.jsonl")], reward=[str(tmp_path / "rewards.py")],
        algo="ppo", critic_model=str(classifier_dir), save_critic=True, lora_rank=lora_rank, n_samples=1,
        prompts_per_step=4, max_new_tokens=4, micro_batch_size=4, steps=1, lr=1e-3, critic_lr=1e-2,
        out=str(out), progress=False)), plugins=plugins)

    saved = load_critic(out / "critic")
    start = load_critic(classifier_dir)
    assert saved.initialised_from == "base_and_head" and saved.head.weight.shape == start.head.weight.shape
    assert not torch.equal(saved.head.weight, start.head.weight)  # the value head trained
    saved_backbone, start_backbone = saved.backbone.state_dict(), start.backbone.state_dict()
    assert saved_backbone.keys() == start_backbone.keys()
    assert any(not torch.equal(saved_backbone[k], start_backbone[k]) for k in saved_backbone)  # so did the body
    assert (out / "critic" / "tokenizer.json").is_file()
