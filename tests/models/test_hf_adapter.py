"""The hf adapter's options on the tiny model: dtype, attention, gradient checkpointing, remote code,
pad token, chat template, and the clear errors for options this machine cannot honour."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from rlhf.core.errors import ConfigError
from rlhf.plugins.models import hf as hf_module
from rlhf.plugins.models import loading as loading_module
from rlhf.plugins.models import lora as lora_module
from rlhf.plugins.models.hf import HFModelAdapter, HFModelConfig
from rlhf.core.logprobs import token_logprobs

pytestmark = pytest.mark.unit


def adapter(**options) -> HFModelAdapter:
    return HFModelAdapter(HFModelConfig(device="cpu", **options))


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (3, 12), generator=generator)  # (B, T)
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0  # one right-padded row
    action_mask = torch.zeros(3, 11)
    action_mask[:, 4:] = 1
    action_mask[2, 8:] = 0
    return ids, mask, action_mask


@pytest.mark.parametrize("name, dtype", [("auto", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16),
                                         ("fp16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_dtype_names(tiny_model_dir, name, dtype):
    model = adapter(dtype=name).load(str(tiny_model_dir), role="policy")
    assert {p.dtype for p in model.parameters()} == {dtype}


def test_unknown_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="--dtype must be auto, float32, fp32"):
        adapter(dtype="int3")


def test_attention_defaults_to_sdpa_and_eager_gives_the_same_logits(tiny_model_dir):
    ids, mask, _ = batch()
    sdpa = adapter().load(str(tiny_model_dir), role="reference")
    eager = adapter(attn_implementation="eager").load(str(tiny_model_dir), role="reference")
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    with torch.no_grad():
        a = sdpa(input_ids=ids[:2], attention_mask=mask[:2]).logits
        b = eager(input_ids=ids[:2], attention_mask=mask[:2]).logits
    assert torch.allclose(a, b, atol=1e-4)


def test_flash_attention_without_the_package_or_a_gpu_is_a_config_error(monkeypatch, tiny_model_dir):
    flash = adapter(attn_implementation="flash_attention_2")  # a process that only reads the tokenizer may build it
    assert flash.load_tokenizer(str(tiny_model_dir)).pad_token_id is not None
    monkeypatch.setattr(loading_module, "is_installed", lambda package: False)
    with pytest.raises(ConfigError, match="needs the flash-attn package"):
        flash.load(str(tiny_model_dir), role="policy")
    monkeypatch.setattr(loading_module, "is_installed", lambda package: True)
    with pytest.raises(ConfigError, match="runs on a CUDA GPU only"):
        flash.load(str(tiny_model_dir), role="reference")
    with pytest.raises(ConfigError, match="must be one of sdpa, eager, flash_attention_2"):
        adapter(attn_implementation="paged")


@pytest.mark.gpu
def test_flash_attention_2_on_a_gpu(tiny_model_dir):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    gpu = HFModelAdapter(HFModelConfig(device="cuda", dtype="bf16", attn_implementation="flash_attention_2"))
    model = gpu.load(str(tiny_model_dir), role="policy")
    assert model.config._attn_implementation == "flash_attention_2"
    ids, mask, action_mask = batch()
    logprobs, _ = token_logprobs(model, ids[:2].cuda(), mask[:2].cuda(), action_mask[:2])
    reference = adapter(dtype="bf16").load(str(tiny_model_dir), role="reference")
    with torch.no_grad():
        expected, _ = token_logprobs(reference, ids[:2], mask[:2], action_mask[:2])
    assert torch.allclose(logprobs.detach().cpu(), expected, atol=5e-2)


def test_4bit_needs_lora_bitsandbytes_and_a_gpu(monkeypatch, tiny_model_dir):
    with pytest.raises(ConfigError, match="add --lora-rank N"):
        adapter(load_in_4bit=True)
    qlora = adapter(load_in_4bit=True, lora_rank=8)  # checked where the models load
    monkeypatch.setattr(lora_module, "is_installed", lambda package: False)
    with pytest.raises(ConfigError, match="needs the bitsandbytes package"):
        qlora.load(str(tiny_model_dir), role="policy")
    monkeypatch.setattr(lora_module, "is_installed", lambda package: True)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        qlora.load(str(tiny_model_dir), role="policy")


def _loss_and_grads(model, ids, mask, action_mask):
    model.train()
    logprobs, _ = token_logprobs(model, ids, mask, action_mask)
    loss = -(logprobs * action_mask).sum() / action_mask.sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_model_dir, lora_rank):
    ids, mask, action_mask = batch()
    results, layer_calls = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same LoRA initialisation in both
        model = adapter(gradient_checkpointing=checkpointing, lora_rank=lora_rank).load(str(tiny_model_dir),
                                                                                      role="policy")
        first_mlp = model.get_decoder().layers[0].mlp  # inside the checkpointed layer
        calls, forward = [], first_mlp.forward
        first_mlp.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)  # hooks skip recompute
        results.append(_loss_and_grads(model, ids, mask, action_mask))
        layer_calls.append(len(calls))
    assert layer_calls == [1, 2]  # checkpointing really recomputed the layer in backward
    (loss, grads), (loss_ckpt, grads_ckpt) = results
    assert loss == pytest.approx(loss_ckpt, abs=1e-6)
    assert grads.keys() == grads_ckpt.keys() and grads
    for name in grads:
        assert torch.allclose(grads[name], grads_ckpt[name], atol=1e-6), name


def _remote_code_model(tmp_path, tiny_model_dir):
    """The tiny Llama re-labelled as a custom architecture whose code ships with the checkpoint."""
    import shutil

    out = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, out)
    (out / "configuration_tiny.py").write_text(textwrap.dedent("""
        from transformers import LlamaConfig

        class TinyConfig(LlamaConfig):
            model_type = "tiny_custom"
    """))
    (out / "modeling_tiny.py").write_text(textwrap.dedent("""
        from transformers import LlamaForCausalLM

        from .configuration_tiny import TinyConfig

        class TinyForCausalLM(LlamaForCausalLM):
            config_class = TinyConfig
    """))
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="tiny_custom", architectures=["TinyForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny.TinyConfig",
                            "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_remote_code_runs_only_when_trusted(tmp_path, tiny_model_dir):
    path = _remote_code_model(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError, match="pass --trust-remote-code"):
        adapter().load(str(path), role="policy")
    model = adapter(trust_remote_code=True).load(str(path), role="policy")
    assert type(model).__name__ == "TinyForCausalLM"


def test_a_tokenizer_without_pad_token_pads_with_eos(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "no-pad")
    loaded = adapter().load_tokenizer(str(tmp_path / "no-pad"))
    assert loaded.pad_token == "<|eos|>" and loaded.pad_token_id == loaded.eos_token_id
    assert adapter().load_tokenizer(str(tiny_model_dir)).pad_token == "<|pad|>"  # an existing one is kept

    class Bare:
        pad_token_id = pad_token = eos_token = unk_token = None

    with pytest.raises(ConfigError, match="no pad, EOS or UNK token"):
        hf_module.set_pad_token(Bare(), "m")


def test_chat_template_file_replaces_the_tokenizers_template(tmp_path, tiny_model_dir):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}### assistant:{% endif %}")
    tokenizer = adapter(chat_template=str(template)).load_tokenizer(str(tiny_model_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "### user: hi\n### assistant:"
    with pytest.raises(ConfigError, match="no such file"):
        adapter(chat_template=str(tmp_path / "missing.jinja")).load_tokenizer(str(tiny_model_dir))


def test_unknown_role_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="not 'judge'"):
        adapter().load(str(tiny_model_dir), role="judge")


@pytest.mark.parametrize("enabled", [False, True])
def test_loading_on_a_gpu_sets_whether_sdpa_may_use_cudnn(enabled, monkeypatch):
    """cuDNN's attention builds a plan per new sequence length (seconds each on an H200): off unless asked."""
    switched: list[bool] = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", switched.append)
    gpu = adapter(cudnn_attention=enabled)
    monkeypatch.setattr(gpu, "device", torch.device("cuda"))
    monkeypatch.setattr(gpu, "_load", lambda ref, role: torch.nn.Linear(2, 2))
    gpu.load("any", role="policy")
    assert switched == [enabled]
    switched.clear()
    monkeypatch.setattr(hf_module.HFModelAdapter, "_load", lambda self, ref, role: torch.nn.Linear(2, 2))
    adapter(cudnn_attention=enabled).load("any", role="policy")
    assert switched == []  # on a CPU nothing is switched


@pytest.mark.gpu
def test_cudnn_attention_is_off_after_loading_on_a_gpu_unless_asked(tiny_model_dir):
    HFModelAdapter(HFModelConfig(device="cuda", dtype="bf16")).load(str(tiny_model_dir), role="policy")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    HFModelAdapter(HFModelConfig(device="cuda", dtype="bf16", cudnn_attention=True)).load(str(tiny_model_dir),
                                                                                           role="reference")
    assert torch.backends.cuda.cudnn_sdp_enabled()
