"""``--aux-loss-coef``: the router load-balancing loss of mixture-of-experts models (Mixtral,
Qwen2-MoE) against transformers' own value, its gradient, the fast paths, and end to end through
``rlhf sft``, ``rlhf dpo`` and ``rlhf train``. Tiny random models (about 100K parameters) built here."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.core.errors import ConfigError
from rlhf.core.logprobs import token_logprobs, without_last_token
from rlhf.fastpaths.packing import PackedModel, packing_path
from rlhf.runtime.step.router_aux import RouterAux
from tests.helpers import command_args, read_jsonl, run_cli, tiny_moe

VOCAB = 320  # the tiny tokenizer's (tiny_model_dir)


def padded_batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, 9) token ids and a right-padded attention mask (rows of 9, 6 and 4 real tokens)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 9), generator=generator)  # (B, T)
    mask = torch.ones_like(ids)  # (B, T)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    return ids * mask, mask


KINDS = ["mixtral", "qwen2_moe"]


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS)
def test_added_aux_loss_is_transformers_own_value_and_its_gradient(kind):
    model = tiny_moe(kind)
    ids, mask = padded_batch()
    coef = 0.25
    # transformers' own: the causal LM called with output_router_logits, aux_loss and the loss it adds
    expected = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    assert expected.aux_loss is not None and float(expected.aux_loss.detach()) > 0
    lm_loss = expected.loss - model.router_aux_loss_coef * expected.aux_loss
    hand_total = lm_loss + coef * expected.aux_loss
    hand_grads = torch.autograd.grad(hand_total, list(model.parameters()), allow_unused=True, retain_graph=True)

    aux = RouterAux.attach(model, coef, "tiny")
    total, metrics = aux.added(lambda: (model(input_ids=ids, attention_mask=mask, labels=ids).loss, {"x": 1.0}))
    assert metrics == {"x": 1.0, "aux_loss": float(expected.aux_loss.detach())}
    assert torch.allclose(total, hand_total, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(total, list(model.parameters()), allow_unused=True)
    for (name, _), got, want in zip(model.named_parameters(), grads, hand_grads):
        assert (got is None) == (want is None), name
        if got is not None:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), name
    # the router's gradient is the aux loss's too: without it, the gate weights get another gradient
    plain = torch.autograd.grad(lm_loss, [p for n, p in model.named_parameters() if n.endswith(".gate.weight")])
    routed = [g for (n, _), g in zip(model.named_parameters(), grads) if n.endswith(".gate.weight")]
    assert len(routed) == 2
    assert all(not torch.allclose(a, b) for a, b in zip(plain, routed))


@pytest.mark.unit
def test_forwards_without_gradients_are_left_out_and_several_forwards_are_token_weighted():
    model = tiny_moe("mixtral")
    ids, mask = padded_batch()
    first = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss  # 19 real tokens
    second = model(input_ids=ids[:1], attention_mask=mask[:1], output_router_logits=True).aux_loss  # 9
    aux = RouterAux.attach(model, 1.0, "tiny")

    def two_forwards_and_a_reference():
        with torch.no_grad():  # a reference forward: not counted
            model(input_ids=ids[1:], attention_mask=mask[1:])
        a = model(input_ids=ids, attention_mask=mask).logits.sum() * 0
        b = model(input_ids=ids[:1], attention_mask=mask[:1]).logits.sum() * 0
        return a + b, {}

    total, metrics = aux.added(two_forwards_and_a_reference)
    expected = (first * 19 + second * 9) / 28
    assert math.isclose(metrics["aux_loss"], float(expected.detach()), rel_tol=1e-6)
    assert torch.allclose(total, expected, atol=1e-6)
    # outside `added`, forwards are the model's own: no router logits asked for
    assert model(input_ids=ids, attention_mask=mask).router_logits is None


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS)
def test_packed_forward_gives_the_aux_loss_of_its_real_tokens(kind):
    """--packing runs the rows as one unpadded row: the loss is over exactly the tokens it ran
    (each row but its last token), as the padded forward with that mask computes it. Where the
    fast path finds packing differs (Qwen2-MoE under transformers 4), the padded forward runs and
    its tokens count."""
    import transformers

    from rlhf.fastpaths.verdicts import verdict

    model = tiny_moe(kind)
    ids, mask = padded_batch()
    action = torch.zeros_like(ids[:, 1:])
    action[:, 2:] = mask[:, 3:]  # (B, A)
    aux = RouterAux.attach(model, 1.0, "tiny")
    packed = PackedModel(model)
    _, metrics = aux.added(lambda: (token_logprobs(packed, ids, mask, action)[0].sum(), {}))
    if verdict(model, packing_path(model, ids, mask)):
        ran = without_last_token(mask)  # (B, T) the tokens the packed forward ran
        expected = model(input_ids=ids, attention_mask=ran, output_router_logits=True).aux_loss
    else:  # the plain path: the padded rows without their last column
        expected = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], output_router_logits=True).aux_loss
    assert verdict(model, packing_path(model, ids, mask)) or int(transformers.__version__.split(".")[0]) < 5
    assert math.isclose(metrics["aux_loss"], float(expected.detach()), rel_tol=1e-5)


@pytest.mark.unit
def test_under_peft_and_gradient_checkpointing_the_loss_and_router_gradient_are_the_plain_ones():
    """peft calls the causal LM's ``forward`` directly (no module hooks fire there): the loss is
    taken at the base model inside; activation checkpointing recomputes the router in backward."""
    from peft import LoraConfig, get_peft_model

    ids, mask = padded_batch()

    def run(wrap):
        model = tiny_moe("mixtral")
        model.train()
        model = wrap(model)
        aux = RouterAux.attach(model, 1.0, "tiny")
        total, metrics = aux.added(lambda: (model(input_ids=ids, attention_mask=mask).logits.sum() * 0, {}))
        total.backward()
        gate = [p for n, p in model.named_parameters() if "layers.0." in n and n.endswith(".gate.weight")][0]
        return metrics["aux_loss"], gate.grad

    def lora(model):
        model.requires_grad_(True)
        peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=[]))
        for name, p in peft.named_parameters():
            p.requires_grad_(name.endswith(".gate.weight") or "lora_" in name)
        return peft

    def checkpointed(model):
        from rlhf.plugins.models.loading import enable_activation_checkpointing

        enable_activation_checkpointing(model)  # as --gradient-checkpointing does
        return model

    plain_aux, plain_grad = run(lambda m: m)
    assert plain_grad is not None and plain_grad.abs().sum() > 0
    for wrap in (lora, checkpointed):
        got_aux, got_grad = run(wrap)
        assert math.isclose(got_aux, plain_aux, rel_tol=1e-6), wrap.__name__
        assert torch.allclose(got_grad, plain_grad, rtol=1e-5, atol=1e-7), wrap.__name__


@pytest.mark.unit
def test_a_model_without_experts_is_a_usage_error(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"--aux-loss-coef 0.1: .*tiny-model.* \(LlamaForCausalLM\) is not a "
                                          r"mixture-of-experts model"):  # a hub name's model: found at load
        RouterAux.attach(model, 0.1, str(tiny_model_dir))
    assert RouterAux.attach(model, 0.0, str(tiny_model_dir)) is None  # 0: off, any model


@pytest.mark.unit
def test_a_reward_model_backbone_gives_transformers_value(tmp_path):
    """``rlhf rm`` trains a backbone under a value head: the loss comes from the backbone's router
    logits through the same transformers function."""
    from rlhf.plugins.models.critic import CriticModel

    lm = tiny_moe("qwen2_moe")
    ids, mask = padded_batch()
    expected = lm(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    scorer = CriticModel(lm.model, hidden_size=32)
    aux = RouterAux.attach(scorer, 1.0, "tiny")
    _, metrics = aux.added(lambda: (scorer(ids, mask).sum(), {}))
    assert math.isclose(metrics["aux_loss"], float(expected.detach()), rel_tol=1e-6)


# --- end to end -----------------------------------------------------------------------------


def _fit(plugins, tmp_path, args, coef):
    out = tmp_path / f"c{coef}"
    result = run_cli(plugins, args + ["--aux-loss-coef", str(coef), "--steps", "1", "--lr", "1e-3",
                                      "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    return read_jsonl(out / "metrics.jsonl")[0]


@pytest.mark.run
@pytest.mark.parametrize("command", ["sft", "dpo", "rm", "kto", "prm", "distill"])
def test_fit_commands_add_the_aux_loss(command, plugins, moe_dir, tiny_model_dir, fit_data, fit_teacher, tmp_path):
    """At step 1 (the same weights, the same micro-batches) the loss with C differs from the loss
    without by exactly C times the logged aux loss; dpo shares no prompt then (its shared forward
    takes a 4D mask, which the router loss cannot use: the run would stop), rm routes through
    its backbone, kto's and distill's other forwards (no gradients, or the teacher) add nothing."""
    args = command_args(command, moe_dir, fit_data, fit_teacher) + [
        "--tokenizer", str(tiny_model_dir), "--batch-size", "4", "--micro-batch-size", "2"]
    plain, with_aux = _fit(plugins, tmp_path, args, 0), _fit(plugins, tmp_path, args, 0.5)
    assert "train/aux_loss" not in plain and with_aux["train/aux_loss"] > 0
    assert math.isclose(with_aux["train/loss"] - plain["train/loss"], 0.5 * with_aux["train/aux_loss"],
                        rel_tol=1e-4, abs_tol=1e-6)


@pytest.mark.run
def test_train_adds_the_aux_loss_to_the_policy_loss(plugins, moe_dir, tiny_model_dir, task, tmp_path):
    def run(coef):
        out = tmp_path / f"rl{coef}"
        result = run_cli(plugins, [
            "train", "--algo", "grpo", "--model", str(moe_dir), "--tokenizer", str(tiny_model_dir),
            "--data", str(task / "data.jsonl"), "--label-key", "answer", "--reward", str(task / "rewards.py"),
            "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "4", "--micro-batch-size", "2",
            "--steps", "1", "--lr", "1e-3", "--aux-loss-coef", str(coef), "--out", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        return read_jsonl(out / "metrics.jsonl")[0]

    plain, with_aux = run(0), run(0.5)
    assert "policy/aux_loss" not in plain and with_aux["policy/aux_loss"] > 0
    assert with_aux["reward/mean"] == plain["reward/mean"]  # the same rollouts
    assert math.isclose(with_aux["policy/loss"] - plain["policy/loss"], 0.5 * with_aux["policy/aux_loss"],
                        rel_tol=1e-4, abs_tol=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize("command", ["sft", "train"])
def test_cli_refuses_the_coefficient_for_a_dense_model_and_a_negative_one(command, plugins, tiny_model_dir, fit_data,
                                                                          task, tmp_path):
    """A dense model's directory is refused before the run starts (no run directory is left)."""
    data = str(fit_data / "sft.jsonl") if command == "sft" else str(task / "data.jsonl")
    args = [command, "--model", str(tiny_model_dir), "--data", data, "--steps", "1", "--no-progress"]
    if command == "train":
        args += ["--reward", str(task / "rewards.py")]
    result = run_cli(plugins, args + ["--aux-loss-coef", "0.1", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2, result.output
    assert f"--aux-loss-coef 0.1: {tiny_model_dir} (LlamaForCausalLM) is not a mixture-of-experts model" in result.output
    assert not (tmp_path / "a").exists()
    result = run_cli(plugins, args + ["--aux-loss-coef", "-1", "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "--aux-loss-coef must be a finite number >= 0" in result.output
    result = run_cli(plugins, args + ["--aux-loss-coef", "0.1", "--ring-attn-size", "2", "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "--aux-loss-coef does not work with --ring-attn-size yet" in result.output
