"""Each built-in objective's loss, logged metrics and gradient, through the real fit loop, against a
computation written here from the models' own forwards.

A test runs the objective's command (``rlhf sft``, ``rlhf rm``, ...) in-process for two optimizer
steps over the same four rows (``--batch-size 4``: step 2 is the second epoch) in micro-batches of
two, on the recording backend (plain SGD that keeps each step's gradient and the weights it was
taken at). It then rebuilds the trained model as it was before step 2, encodes the rows by
hand (prompt tokens, response tokens, EOS; nothing from ``rlhf``), computes the method's formula
with plain torch, and asserts that step 2's metrics in metrics.jsonl (the loss, every metric the
objective logs, the step's units) and step 2's gradient equal it.

Step 1 moves the model away from its start, so the reference (the starting model, frozen) and the
trained model differ at step 2: a reference taken from the policy, a KL estimate that is always
0, a term on the wrong responses or swapped coefficients all change the numbers. Each test also
asserts that the quantity such a bug would erase is far from zero at step 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.helpers import ROOT, assert_same_gradients, run_cli, write_jsonl
from tests.runtime.recording import RecordingBackend, recording_plugin

pytestmark = pytest.mark.run

# Loop-level entries of a step's metrics (the rest is the objective's: its loss and its metrics).
LOOP_METRICS = {"train/grad_norm", "train/lr", "train/skipped", "train/skipped_steps", "train/epoch", "train/units"}
BATCH, MICRO = 4, 2
PROMPTS = ["Q: cat?", "Q: the quick brown fox?", "Q: 12 + 7?", "Q: say hello to the world?"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """Another random model with the same tokenizer."""
    from rlhf.core.plugin_host.references import import_object

    build = import_object(f"{ROOT / 'examples' / 'tiny_model.py'}:build_random_model")
    return build(tmp_path_factory.mktemp("value-teacher"), seed=11)


def tokens(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_response(tokenizer, prompt: str, response: str) -> tuple[list[int], int]:
    """``(ids, prompt_len)``: prompt tokens + response tokens + EOS; the response and EOS are learnt."""
    prompt_ids = list(tokenizer(prompt)["input_ids"])
    return prompt_ids + tokens(tokenizer, response) + [tokenizer.eos_token_id], len(prompt_ids)


def train_two_steps(args: list[str], out: Path, lr: float) -> tuple[dict, dict, dict]:
    """Step 2's metrics row, the weights step 2 started from and step 2's gradient."""
    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(recording_plugin())
    RecordingBackend.clear()
    result = run_cli(plugins, args + ["--batch-size", str(BATCH), "--micro-batch-size", str(MICRO), "--steps", "2",
                                      "--lr", str(lr), "--backend", "recording", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in train] == [1, 2]
    assert len(RecordingBackend.steps) == 2
    return train[1], RecordingBackend.weights[1], RecordingBackend.steps[1]


def assert_step(logged: dict, expected: dict[str, torch.Tensor], units: float) -> None:
    """The step's loss and every metric the objective logs equal ``expected``; none is missing or extra."""
    objective_keys = {key for key in logged if key.startswith("train/")} - LOOP_METRICS
    assert objective_keys == {f"train/{name}" for name in expected}
    for name, value in expected.items():
        assert logged[f"train/{name}"] == pytest.approx(float(value.detach()), rel=1e-4, abs=1e-6), name
    assert logged["train/units"] == units
    assert 0 < logged["time/step"] < 60


def causal_lm(model_dir: Path, weights: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """The model of ``model_dir`` in float32, with ``weights`` (all of its parameters) when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model.eval()


def logprobs_by_hand(model: torch.nn.Module, ids: list[int], start: int) -> torch.Tensor:
    """(N,) log-probs of tokens ``ids[start:]``, each predicted from the tokens before it."""
    logits = model(torch.tensor([ids])).logits[0].float()  # (T, V)
    targets = torch.tensor(ids[start:])  # (N,)
    return logits[start - 1:-1].log_softmax(-1).gather(1, targets[:, None]).squeeze(1)  # (N,)


def gradients(loss: torch.Tensor, named: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(named.items(), grads)}


# --- sft ---------------------------------------------------------------------------------------


# the last prompt is one token: the loss mask's second position is then a response token
SFT_ROWS = [{"prompt": p, "response": r} for p, r in zip(PROMPTS[:3] + ["7"], ["cat cat", "jumps over the lazy dog",
                                                                              "19", "hello world!"])]


def test_sft_is_the_mean_nll_of_every_response_token_of_the_step(tiny_model_dir, tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    logged, weights, grad = train_two_steps(["sft", "--model", str(tiny_model_dir), "--data", str(data)],
                                            tmp_path / "run", lr=0.5)
    model = causal_lm(tiny_model_dir, weights)
    logprobs = torch.cat([logprobs_by_hand(model, *prompt_response(tokenizer, row["prompt"], row["response"]))
                       for row in SFT_ROWS])  # (N,) every learnt token of the step
    loss = -logprobs.mean()
    assert_step(logged, {"loss": loss}, units=float(len(logprobs)))
    assert_same_gradients(grad, gradients(loss, dict(model.named_parameters())), atol=1e-5)


# --- distill -----------------------------------------------------------------------------------


def test_distill_mixes_the_nll_and_the_cross_entropy_to_the_teacher_by_kd_coef(tiny_model_dir, teacher_dir,
                                                                                tokenizer, tmp_path):
    kd_coef = 0.3
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    logged, weights, grad = train_two_steps(["distill", "--model", str(tiny_model_dir), "--data", str(data),
                                             "--teacher", str(teacher_dir), "--kd-coef", str(kd_coef)],
                                            tmp_path / "run", lr=0.5)
    student, teacher = causal_lm(tiny_model_dir, weights), causal_lm(teacher_dir)
    nll, cross_entropy = [], []
    for row in SFT_ROWS:
        ids, start = prompt_response(tokenizer, row["prompt"], row["response"])
        inputs = torch.tensor([ids])
        student_logprobs = student(inputs).logits[0, start - 1:-1].float().log_softmax(-1)  # (N, V)
        with torch.no_grad():
            teacher_probs = teacher(inputs).logits[0, start - 1:-1].float().softmax(-1)  # (N, V)
        nll.append(-student_logprobs.gather(1, torch.tensor(ids[start:])[:, None]).squeeze(1))  # (N,)
        cross_entropy.append(-(teacher_probs * student_logprobs).sum(-1))  # (N,)
    sft_term, kd_term = torch.cat(nll).mean(), torch.cat(cross_entropy).mean()
    loss = (1 - kd_coef) * sft_term + kd_coef * kd_term
    assert abs(float((kd_term - sft_term).detach())) > 0.1  # swapped coefficients would show
    assert_step(logged, {"loss": loss, "sft_loss": sft_term, "kd_loss": kd_term},
                units=float(sum(len(n) for n in nll)))
    assert_same_gradients(grad, gradients(loss, dict(student.named_parameters())), atol=1e-5)


# --- rm ----------------------------------------------------------------------------------------


PAIR_ROWS = [{"prompt": p, "chosen": c, "rejected": r, "margin": m}
             for p, c, r, m in zip(PROMPTS, ["cat", "jumps over the lazy dog", "19", "hello world!"],
                                   ["dog dog dog", "fox", "12 + 7 = 20 or so", "goodbye"], [0.5, 0.0, 1.5, 0.25])]


@pytest.mark.parametrize("loss_kind", ["sigmoid", "logexp"])
def test_rm_scores_the_last_token_and_takes_the_pairwise_loss(loss_kind, tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModel

    data = write_jsonl(tmp_path / "pairs.jsonl", PAIR_ROWS)
    args = ["rm", "--model", str(tiny_model_dir), "--data", str(data), "--loss", loss_kind]
    if loss_kind == "sigmoid":
        args += ["--margin-key", "margin"]
    logged, weights, grad = train_two_steps(args, tmp_path / "run", lr=0.5)
    backbone = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    backbone.load_state_dict({k.removeprefix("backbone."): v for k, v in weights.items() if k.startswith("backbone.")},
                             strict=True)
    head = weights["score.weight"].clone().requires_grad_(True)  # (1, H)

    def score(text: str) -> torch.Tensor:
        ids = tokens(tokenizer, text) + [tokenizer.eos_token_id]  # the whole text, then EOS: scored at EOS
        hidden = backbone(torch.tensor([ids])).last_hidden_state[0, -1]  # (H,)
        return (head @ hidden).squeeze(0)  # ()

    chosen = torch.stack([score(row["prompt"] + row["chosen"]) for row in PAIR_ROWS])  # (P,)
    rejected = torch.stack([score(row["prompt"] + row["rejected"]) for row in PAIR_ROWS])  # (P,)
    margin = torch.tensor([row["margin"] for row in PAIR_ROWS])  # (P,)
    if loss_kind == "sigmoid":
        loss = -F.logsigmoid(chosen - rejected - margin).mean()
    else:
        loss = torch.log1p(torch.exp(rejected - chosen)).mean()
    gap = (chosen - rejected).detach()  # (P,)
    assert_step(logged, {"loss": loss, "accuracy": (gap > 0).float().mean(), "margin": gap.mean(),
                         "chosen_score": chosen.mean(), "rejected_score": rejected.mean()},
                units=float(len(PAIR_ROWS)))
    named = {f"backbone.{n}": p for n, p in backbone.named_parameters()} | {"score.weight": head}
    assert_same_gradients(grad, gradients(loss, named), atol=1e-5)


# --- dpo ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["dpo", "ipo", "label_smoothing", "nll"])
def test_dpo_and_its_variants_against_the_frozen_starting_model(variant, tiny_model_dir, tokenizer, tmp_path):
    beta, smoothing, nll_coef = 0.5, 0.2, 0.3
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIR_ROWS)
    args = ["dpo", "--model", str(tiny_model_dir), "--data", str(data), "--beta", str(beta)]
    args += {"dpo": [], "ipo": ["--ipo"], "label_smoothing": ["--label-smoothing", str(smoothing)],
             "nll": ["--nll-coef", str(nll_coef)]}[variant]
    logged, weights, grad = train_two_steps(args, tmp_path / "run", lr=2.0)
    policy, reference = causal_lm(tiny_model_dir, weights), causal_lm(tiny_model_dir)

    def summed(model: torch.nn.Module, response: str, prompt: str) -> torch.Tensor:
        return logprobs_by_hand(model, *prompt_response(tokenizer, prompt, response)).sum()

    sums = {}
    for side in ("chosen", "rejected"):
        sums[side] = torch.stack([summed(policy, row[side], row["prompt"]) for row in PAIR_ROWS])  # (P,)
        with torch.no_grad():
            sums[f"ref_{side}"] = torch.stack([summed(reference, row[side], row["prompt"]) for row in PAIR_ROWS])
    chosen_logratio = sums["chosen"] - sums["ref_chosen"]  # (P,)
    rejected_logratio = sums["rejected"] - sums["ref_rejected"]  # (P,)
    assert float(chosen_logratio.abs().min()) > 1e-3  # the policy has moved away from the reference
    h = chosen_logratio - rejected_logratio  # (P,)
    if variant == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif variant == "label_smoothing":
        losses = -(1 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)
    else:
        losses = -F.logsigmoid(beta * h)
    loss = losses.mean()
    chosen_rewards, rejected_rewards = beta * chosen_logratio.detach(), beta * rejected_logratio.detach()  # (P,)
    gap = chosen_rewards - rejected_rewards
    expected = {"accuracy": (gap > 0).float().mean(), "margin": gap.mean(), "chosen_reward": chosen_rewards.mean(),
                "rejected_reward": rejected_rewards.mean()}
    if variant == "nll":
        per_token_nll = torch.stack([
            -logprobs_by_hand(policy, *prompt_response(tokenizer, row["prompt"], row["chosen"])).mean()
            for row in PAIR_ROWS])  # (P,) mean over each chosen response's tokens
        loss = loss + nll_coef * per_token_nll.mean()
        expected["nll"] = per_token_nll.mean()
    expected["loss"] = loss
    assert_step(logged, expected, units=float(len(PAIR_ROWS)))
    assert_same_gradients(grad, gradients(loss, dict(policy.named_parameters())), atol=1e-5)


# --- kto ---------------------------------------------------------------------------------------


KTO_ROWS = [{"prompt": p, "completion": c, "label": d}
            for p, c, d in zip(PROMPTS, ["cat", "jumps over the lazy dog", "20", "hello world!"],
                               [True, True, False, True])]


def test_kto_against_a_reference_point_from_mismatched_pairs(tiny_model_dir, tokenizer, tmp_path):
    from rlhf.runtime.fit.data import StepOrder

    beta, desirable_weight, undesirable_weight, seed = 0.5, 1.5, 0.7, 42
    data = write_jsonl(tmp_path / "kto.jsonl", KTO_ROWS)
    logged, weights, grad = train_two_steps(
        ["kto", "--model", str(tiny_model_dir), "--data", str(data), "--beta", str(beta), "--desirable-weight",
         str(desirable_weight), "--undesirable-weight", str(undesirable_weight), "--seed", str(seed)],
        tmp_path / "run", lr=2.0)
    policy, reference = causal_lm(tiny_model_dir, weights), causal_lm(tiny_model_dir)
    rows = [KTO_ROWS[i] for i in StepOrder(len(KTO_ROWS), BATCH, seed).indices(1)]  # step 2, in the loop's order
    encoded = [prompt_response(tokenizer, row["prompt"], row["completion"]) for row in rows]

    # z: each prompt with the next row's completion (EOS included), within the longer of the two sequences
    with torch.no_grad():
        kl_terms = []
        for index, (ids, prompt_len) in enumerate(encoded):
            other_ids, other_prompt_len = encoded[(index + 1) % len(encoded)]
            mismatched = (ids[:prompt_len] + other_ids[other_prompt_len:])[:max(len(ids), len(other_ids))]
            kl_terms.append(logprobs_by_hand(policy, mismatched, prompt_len).sum()
                            - logprobs_by_hand(reference, mismatched, prompt_len).sum())
        z = torch.stack(kl_terms).mean().clamp(min=0)
    assert float(z) > 1e-3  # a reference point that is always 0 would show

    with torch.no_grad():
        reference_sums = torch.stack([logprobs_by_hand(reference, ids, start).sum() for ids, start in encoded])  # (B,)
    logratios = torch.stack([logprobs_by_hand(policy, ids, start).sum() for ids, start in encoded]) - reference_sums
    desirable = torch.tensor([row["label"] for row in rows])  # (B,)
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratios - z))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z - logratios))))  # (B,)
    loss = losses.mean()
    rewards = beta * logratios.detach()  # (B,)
    right_side = torch.where(desirable, logratios.detach() > z, logratios.detach() < z)  # (B,)
    assert_step(logged, {"loss": loss, "accuracy": right_side.float().mean(), "kl": z,
                         "chosen_reward": rewards[desirable].mean(),
                         "rejected_reward": rewards[~desirable].mean()}, units=float(len(rows)))
    assert_same_gradients(grad, gradients(loss, dict(policy.named_parameters())), atol=1e-5)


# --- prm ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("labels", ["hard", "soft"])
def test_prm_is_the_cross_entropy_over_the_reward_tokens_at_each_placeholder(labels, tiny_model_dir, tokenizer,
                                                                             tmp_path):
    texts = ["cat @ dog @", "the quick brown fox @", "12 + 7 @ = 19 @ hello world @", "say hello @"]
    hard = [["+", "-"], ["-"], ["+", "+", "-"], ["+"]]
    soft = [[0.9, 0.2], [0.3], [0.6, 1.0, 0.0], [0.75]]
    rows = [{"input": t, "label": h if labels == "hard" else s} for t, h, s in zip(texts, hard, soft)]
    data = write_jsonl(tmp_path / "steps.jsonl", rows)
    logged, weights, grad = train_two_steps(["prm", "--model", str(tiny_model_dir), "--data", str(data),
                                             "--placeholder-token", "@", "--reward-tokens", "+", "-"],
                                            tmp_path / "run", lr=0.5)
    model = causal_lm(tiny_model_dir, weights)
    placeholder, plus, minus = (tokens(tokenizer, t) for t in ("@", "+", "-"))
    assert len(placeholder) == len(plus) == len(minus) == 1
    step_logits, targets = [], []
    for row in rows:
        ids = tokens(tokenizer, row["input"])
        positions = [i for i, token in enumerate(ids) if token == placeholder[0]]
        assert len(positions) == len(row["label"])
        logits = model(torch.tensor([ids])).logits[0].float()  # (T, V)
        step_logits.append(logits[positions][:, [plus[0], minus[0]]])  # (S, 2): the reward tokens at each step
        if labels == "hard":
            targets += [torch.tensor([1.0, 0.0]) if label == "+" else torch.tensor([0.0, 1.0]) for label in row["label"]]
        else:
            targets += [torch.tensor([label, 1 - label]) for label in row["label"]]
    step_logits, target = torch.cat(step_logits), torch.stack(targets)  # (S, 2), (S, 2)
    loss = -(target * step_logits.log_softmax(-1)).sum(-1).mean()
    accuracy = (step_logits.argmax(-1) == target.argmax(-1)).float().mean()
    assert_step(logged, {"loss": loss, "accuracy": accuracy}, units=float(len(target)))
    assert_same_gradients(grad, gradients(loss, dict(model.named_parameters())), atol=1e-5)


def test_dpo_runs_each_pair_as_one_row_sharing_its_prompt_unless_told_not_to(tiny_model_dir, tmp_path, monkeypatch):
    """The numbers above are the same either way; this pins that the default takes the shared forward."""
    from rlhf.plugins.objectives import dpo as dpo_module

    shared_calls: list[int] = []
    original = dpo_module.shared_learnt_logprobs
    monkeypatch.setattr(dpo_module, "shared_learnt_logprobs",
                        lambda *args, **kwargs: shared_calls.append(1) or original(*args, **kwargs))
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIR_ROWS)
    args = ["dpo", "--model", str(tiny_model_dir), "--data", str(data)]
    train_two_steps(args, tmp_path / "shared", lr=0.1)
    assert shared_calls
    shared_calls.clear()
    train_two_steps(args + ["--no-share-prompt"], tmp_path / "separate", lr=0.1)
    assert not shared_calls
