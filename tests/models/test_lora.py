"""LoRA through peft on the tiny model: only adapters train, the reference is the base model without
a second copy of its weights, the saved adapter loads with peft, merging matches, resume is exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.plugins.models.hf import HFModelAdapter, HFModelConfig
from rlhf.plugins.models.hf import LoRAModelAdapter
from rlhf.plugins.models.lora import AdapterDisabledModel
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.rl.local import train
from rlhf.core.logprobs import token_logprobs
from tests.helpers import read_jsonl, run_cli


def small_config(model_dir, task, out, **overrides):
    values = dict(model=str(model_dir), data=[str(task / "data.jsonl")], label_key="answer",
                  reward=[str(task / "rewards.py")], prompts_per_step=2, n_samples=2, max_new_tokens=4,
                  micro_batch_size=2, steps=2, lr=1e-2, out=str(out), progress=False, seed=7, lora_rank=8)
    values.update(overrides)
    return TrainConfig.from_dict(values)


def lora_policy(model_dir, **options):
    adapter = HFModelAdapter(HFModelConfig(device="cpu", lora_rank=8, **options))
    return adapter, adapter.load(str(model_dir), role="policy")


def batch():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 300, (3, 10), generator=generator)  # (B, T)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    action_mask = torch.zeros(3, 9)
    action_mask[:, 3:] = 1
    action_mask[1, 6:] = 0
    return ids, mask, action_mask


def perturb_adapters(model):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)


@pytest.fixture(scope="module")
def recorded_run(tiny_model_dir, task, tmp_path_factory):
    """A LoRA GRPO run whose adapter records the models it built."""
    loaded = {}

    class Recording(HFModelAdapter):
        def load(self, ref, *, role):
            loaded[role] = super().load(ref, role=role)
            return loaded[role]

    plugins = build_plugin_manager(load_entrypoints=False)
    module = type(sys)("recording_models")
    import rlhf

    module.register_models = rlhf.hookimpl(lambda register: register(
        "recording", Recording, config_cls=HFModelConfig))
    plugins.register(module)
    out = tmp_path_factory.mktemp("lora-run") / "run"
    train(small_config(tiny_model_dir, task, out, model_adapter="recording", merge_lora=True,
                       kl_coef=0.01), plugins=plugins)
    return out, loaded


@pytest.mark.run
def test_lora_grpo_run_changes_only_adapter_weights(recorded_run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    _, loaded = recorded_run
    policy, initial = loaded["policy"], AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    for name, tensor in policy.get_base_model().state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(tensor, initial[name.replace(".base_layer.", ".")]), name
    lora_b = [p for n, p in policy.named_parameters() if "lora_B" in n]
    assert all(torch.count_nonzero(p) > 0 for p in lora_b)  # B starts at 0: every adapter moved
    assert isinstance(loaded["reference"], AdapterDisabledModel) and loaded["reference"].policy is policy


@pytest.mark.unit
def test_reference_logprobs_equal_the_base_models_without_a_second_copy(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    adapter, policy = lora_policy(tiny_model_dir)
    perturb_adapters(policy)  # the policy now differs from the base model
    reference = adapter.load(str(tiny_model_dir), role="reference")
    reference.eval().requires_grad_(False)  # what a caller may do to a frozen model: must not freeze the policy
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids, mask, action_mask = batch()
    policy.train()
    with torch.no_grad():
        ref_logprobs, _ = token_logprobs(reference, ids, mask, action_mask)
        base_logprobs, _ = token_logprobs(base, ids, mask, action_mask)
        policy_logprobs, _ = token_logprobs(policy, ids, mask, action_mask)
    assert torch.allclose(ref_logprobs, base_logprobs, atol=1e-6)
    assert (ref_logprobs - policy_logprobs).abs().max() > 1e-2
    assert policy.training and any(p.requires_grad for p in policy.parameters())

    pointers = lambda m: {p.data_ptr() for p in m.parameters()}  # noqa: E731
    assert pointers(reference) == pointers(policy)  # the view owns no weights of its own
    ref_logprobs_again, _ = token_logprobs(reference, ids, mask, action_mask)
    assert not ref_logprobs_again.requires_grad  # frozen even when called with gradients on


@pytest.mark.run
def test_saved_adapter_loads_with_peft_and_the_merged_model_matches(recorded_run, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, loaded = recorded_run
    final = out / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (8, 16, str(tiny_model_dir))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final).eval()
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids, mask, _ = batch()
    loaded["policy"].eval()
    with torch.no_grad():
        live = loaded["policy"](input_ids=ids, attention_mask=mask).logits
        from_peft = adapted(input_ids=ids, attention_mask=mask).logits
        from_merged = merged(input_ids=ids, attention_mask=mask).logits
        from_base = base(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(from_peft, live, atol=1e-5)
    assert torch.allclose(from_merged, from_peft, atol=1e-4)
    assert (from_merged - from_base).abs().max() > 1e-3  # the merge carried the training
    assert not any("lora" in k for k in merged.state_dict())


@pytest.mark.run
def test_merge_lora_command(recorded_run, tiny_model_dir, tmp_path, plugins):
    from transformers import AutoModelForCausalLM

    final = recorded_run[0] / "final"
    result = run_cli(plugins, ["merge-lora", str(final), "--out", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    explicit = run_cli(plugins, ["merge-lora", str(final), "--base", str(tiny_model_dir), "--dtype", "fp32",
                                 "--out", str(tmp_path / "explicit")])
    assert explicit.exit_code == 0, explicit.output
    expected = AutoModelForCausalLM.from_pretrained(final / "merged").state_dict()
    for directory in ("merged", "explicit"):
        state = AutoModelForCausalLM.from_pretrained(tmp_path / directory).state_dict()
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[k], expected[k]) for k in state), directory
        assert (tmp_path / directory / "tokenizer.json").is_file()
    not_adapter = run_cli(plugins, ["merge-lora", str(tiny_model_dir), "--out", str(tmp_path / "x")])
    assert not_adapter.exit_code == 2 and "is not a LoRA adapter directory" in not_adapter.output
    not_empty = run_cli(plugins, ["merge-lora", str(final), "--out", str(tmp_path / "merged")])
    assert not_empty.exit_code == 2 and "is not empty" in not_empty.output


@pytest.mark.unit
def test_rank_alpha_dropout_and_target_modules_reach_peft(tiny_model_dir):
    _, policy = lora_policy(tiny_model_dir, lora_alpha=32, lora_dropout=0.1, target_modules=["q_proj,v_proj"])
    config = policy.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 32, 0.1)
    adapted = {n.rsplit(".", 1)[-1] for n, m in policy.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "v_proj"}
    assert policy.get_base_model().model.layers[0].self_attn.q_proj.scaling["default"] == 32 / 8

    _, everything = lora_policy(tiny_model_dir)  # default: every linear layer but the output head
    adapted = {n.rsplit(".", 1)[-1] for n, m in everything.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with pytest.raises(ConfigError, match="LoRA could not adapt the model"):
        lora_policy(tiny_model_dir, target_modules=["no_such_proj"])
    with pytest.raises(ConfigError, match="--lora-rank >= 1"):
        HFModelAdapter(HFModelConfig(device="cpu", lora_rank=8, lora_dropout=1.5))


@pytest.mark.unit
def test_lora_adapter_by_name_defaults_to_rank_8(plugins, tiny_model_dir):
    adapter_cls = plugins.registry("model").get("lora")
    assert adapter_cls is LoRAModelAdapter
    policy = adapter_cls(HFModelConfig(device="cpu")).load(str(tiny_model_dir), role="policy")
    assert policy.peft_config["default"].r == 8
    assert adapter_cls(HFModelConfig(device="cpu", lora_rank=4)).lora.config.lora_rank == 4
    assert HFModelAdapter(HFModelConfig(device="cpu")).lora is None  # hf without --lora-rank: full fine-tuning


def _final_adapter(out):
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "adapter_model.safetensors"))


@pytest.mark.run
def test_resume_with_lora_reproduces_the_uninterrupted_run(tiny_model_dir, task, tmp_path, make_plugin):
    straight = tmp_path / "straight"
    train(small_config(tiny_model_dir, task, straight, steps=4, save_every=2, kl_coef=0.01),
          plugins=build_plugin_manager(load_entrypoints=False))

    def crash(step):
        if step == 2:
            raise KeyboardInterrupt  # killed right after the step-2 checkpoint

    interrupted = tmp_path / "interrupted"
    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(make_plugin("killer", on_checkpoint=crash))
    with pytest.raises(KeyboardInterrupt):
        train(small_config(tiny_model_dir, task, interrupted, steps=4, save_every=2, kl_coef=0.01), plugins=plugins)
    train(small_config(tiny_model_dir, task, interrupted, steps=4, save_every=2, kl_coef=0.01, resume=True),
          plugins=build_plugin_manager(load_entrypoints=False))

    keys = ("reward/mean", "policy/loss", "policy/grad_norm", "kl/mean")
    expected = [{k: m[k] for k in keys} for m in read_jsonl(straight / "metrics.jsonl")]
    assert [{k: m[k] for k in keys} for m in read_jsonl(interrupted / "metrics.jsonl")] == expected
    a, b = _final_adapter(straight), _final_adapter(interrupted)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.run
def test_cli_train_with_lora_rank_end_to_end(tiny_model_dir, task, tmp_path):
    """`rlhf train --lora-rank 8 ...` as a user runs it, with a chat template from a file."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    out = tmp_path / "run"
    (tmp_path / "base").symlink_to(tiny_model_dir)  # --model as a relative path, as users write it
    args = ["--model", "./base", "--data", str(task / "data.jsonl"), "--reward", str(task / "rewards.py"),
            "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "4", "--steps", "1",
            "--lora-rank", "8", "--lora-alpha", "8", "--target-modules", "q_proj,v_proj", "--merge-lora",
            "--chat-template", str(template), "--apply-chat-template", "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "rlhf", "train", *args], capture_output=True, text=True,
                            env={**os.environ, "RLHF_LOAD_PLUGINS": ""}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    merged = subprocess.run([sys.executable, "-m", "rlhf", "merge-lora", str(out / "final"), "--out", "merged"],
                            capture_output=True, text=True, env={**os.environ, "RLHF_LOAD_PLUGINS": ""}, cwd=elsewhere)
    assert merged.returncode == 0, merged.stderr[-3000:]  # the adapter names its base by an absolute path
    assert (elsewhere / "merged" / "config.json").is_file()
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (8, 8, ["q_proj", "v_proj"])
    assert (out / "final" / "merged" / "config.json").is_file()
    prompts = [s["prompt"] for s in read_jsonl(out / "samples.jsonl")]
    assert prompts and all(p.startswith("<<user>> What is ") and p.endswith("<<assistant>>") for p in prompts)


@pytest.mark.run
@pytest.mark.gpu
def test_qlora_trains_adapters_on_4bit_weights(tiny_model_dir):
    bnb = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes")
    adapter = HFModelAdapter(HFModelConfig(device="cuda", dtype="bf16", lora_rank=8, load_in_4bit=True))
    policy = adapter.load(str(tiny_model_dir), role="policy")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in policy.modules())
    reference = adapter.load(str(tiny_model_dir), role="reference")
    assert isinstance(reference, AdapterDisabledModel)
    ids, mask, action_mask = batch()
    ids, mask = ids.cuda(), mask.cuda()
    perturb_adapters(policy)
    with torch.no_grad():
        ref_logprobs, _ = token_logprobs(reference, ids, mask, action_mask)
        policy_logprobs, _ = token_logprobs(policy, ids, mask, action_mask)
    assert (ref_logprobs - policy_logprobs).abs().max() > 1e-3
    policy.train()
    logprobs, _ = token_logprobs(policy, ids, mask, action_mask)
    (-(logprobs * action_mask.cuda()).sum()).backward()
    grads = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)
