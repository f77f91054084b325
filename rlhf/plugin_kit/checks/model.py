"""Contract of a model adapter (``register_models``), on a tiny random Llama.

``load_tokenizer`` gives a pad token; ``policy`` is a trainable causal LM whose logits are
``(B, T, V)`` and which generates; ``reference`` (when the adapter builds it) starts equal to the
policy, has no trainable weight of its own, leaves the policy trainable, and does not move when the policy
trains; ``critic`` and ``reward`` return float32 values ``(B, T)``; ``save`` writes a directory
that ``AutoModelForCausalLM.from_pretrained`` loads back with the same logits (``save_critic``:
a directory that loads too).
"""

from __future__ import annotations

from typing import Any

from rlhf.plugin_kit.checks.target import Target, expect_close, expect_tensor, guarded

B, T = 2, 7


def check(target: Target) -> list[str]:
    import torch

    ref = str(target.tiny_model())
    roles = tuple(target.capabilities.get("roles") or ("policy",))
    adapter = guarded(target, "creating the adapter", lambda: target.obj(target.config(model=ref, tokenizer=ref)))
    tokenizer = guarded(target, "load_tokenizer", lambda: adapter.load_tokenizer(ref))
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise target.fail("load_tokenizer returned a tokenizer without a pad token; set one")
    torch.manual_seed(0)
    input_ids = torch.randint(5, len(tokenizer), (B, T))  # (B, T)
    attention_mask = torch.ones(B, T, dtype=torch.long)  # (B, T)
    attention_mask[1, -2:] = 0

    policy = guarded(target, "load(role='policy')", lambda: adapter.load(ref, role="policy"))
    vocab = len(tokenizer)
    logits = _logits(target, "policy", policy, input_ids, attention_mask)
    if logits.shape[:2] != (B, T) or logits.shape[2] < vocab:
        raise target.fail(f"the policy's logits have shape {tuple(logits.shape)}, expected ({B}, {T}, >= {vocab})")
    trainable = [p for p in policy.parameters() if p.requires_grad]
    if not trainable:
        raise target.fail("the policy has no trainable parameter")
    generated = guarded(target, "policy.generate", lambda: policy.generate(
        input_ids=input_ids[:1], attention_mask=attention_mask[:1], max_new_tokens=3, do_sample=False,
        pad_token_id=tokenizer.pad_token_id))
    if generated.shape[1] <= T:
        raise target.fail("policy.generate added no token")
    lines = [f"policy: logits ({B}, {T}, {logits.shape[2]}), {sum(p.numel() for p in trainable)} trainable "
             "parameters, generate works"]

    if "reference" in roles:
        lines.append(_check_reference(target, adapter, ref, policy, logits, input_ids, attention_mask))
    for role in ("critic", "reward"):
        if role in roles:
            model = guarded(target, f"load(role={role!r})", lambda r=role: adapter.load(ref, role=r))
            values = guarded(target, f"the {role}'s forward", lambda m=model: m(input_ids, attention_mask))
            values = getattr(values, "logits", values)
            expect_tensor(target, f"the {role}'s values", values, (B, T))
            if values.dtype != torch.float32:
                raise target.fail(f"the {role}'s values should be float32, got {values.dtype}")
            lines.append(f"{role}: values ({B}, {T}) float32")
            if role == "critic":
                out = target.workdir() / "critic"
                guarded(target, "save_critic", lambda m=model: adapter.save_critic(m, tokenizer, out))
                if not (out / "config.json").exists():
                    raise target.fail(f"save_critic wrote no config.json in {out}")
                lines.append("save_critic writes a model directory")

    out = target.workdir() / "policy"
    policy.eval()
    with torch.no_grad():
        expected = _logits(target, "policy", policy, input_ids, attention_mask)
    guarded(target, "save", lambda: adapter.save(policy, tokenizer, out))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        AutoTokenizer.from_pretrained(out)
    except Exception as exc:
        raise target.fail(f"save wrote {out}, which AutoModelForCausalLM/AutoTokenizer.from_pretrained cannot load: "
                          f"{type(exc).__name__}: {exc}") from exc
    with torch.no_grad():
        reloaded = loaded(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    expect_close(target, "the exported policy, loaded back with from_pretrained, gives different logits than the "
                 "trained one", reloaded[attention_mask.bool()], expected[attention_mask.bool()], atol=1e-4)
    lines.append("save: the export loads back with from_pretrained and gives the same logits")
    return lines


def _check_reference(target: Target, adapter: Any, ref: str, policy: Any, logits: Any, input_ids: Any,
                     attention_mask: Any) -> str:
    import torch

    was_training = policy.training
    trainable_before = [p.requires_grad for p in policy.parameters()]
    reference = guarded(target, "load(role='reference')", lambda: adapter.load(ref, role="reference"))
    if [p.requires_grad for p in policy.parameters()] != trainable_before or policy.training != was_training:
        raise target.fail("loading the reference changed the policy's trainability or train/eval mode")
    shared = {id(p) for p in policy.parameters()}  # LoRA's reference is a view of the policy: shared is fine
    if any(p.requires_grad and id(p) not in shared for p in reference.parameters()):
        raise target.fail("the reference has trainable parameters of its own; freeze it (requires_grad_(False))")
    with torch.no_grad():
        before = _logits(target, "reference", reference, input_ids, attention_mask)
    mask = attention_mask.bool()
    expect_close(target, "the reference should start equal to the policy (same logits)", before[mask],
                 logits.detach()[mask], atol=1e-4)
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    _logits(target, "policy", policy, input_ids, attention_mask).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = _logits(target, "reference", reference, input_ids, attention_mask)
        moved = _logits(target, "policy", policy, input_ids, attention_mask)
    expect_close(target, "training the policy changed the reference's outputs; the reference must stay frozen "
                 "at the starting weights", after[mask], before[mask], atol=1e-5)
    if torch.allclose(moved[mask], before[mask]):
        raise target.fail("an optimizer step on the policy's trainable parameters did not change its outputs")
    return "reference: equal to the policy at the start, frozen, unchanged when the policy trains"


def _logits(target: Target, who: str, model: Any, input_ids: Any, attention_mask: Any) -> Any:
    out = guarded(target, f"the {who}'s forward", lambda: model(input_ids=input_ids, attention_mask=attention_mask))
    logits = getattr(out, "logits", None)
    if logits is None:
        raise target.fail(f"the {who}'s forward should return an object with .logits, got {type(out).__name__}")
    return logits.float()

