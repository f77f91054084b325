"""Deliberately broken components, one mistake each, for the contract-check tests. Module-level so
the reward and backend ones pickle like real plugin code would."""

from __future__ import annotations

import torch

from rlhf.api import AdvantageConfig, AdvantageInputs, ModelAdapterBase


def _group_centered(inputs: AdvantageInputs, std: bool) -> torch.Tensor:
    rewards = inputs.rewards.view(-1, inputs.group_size)  # (G, n)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if std:
        centered = centered / rewards.std(dim=1, keepdim=True)  # no epsilon: NaN on a constant group
    return centered.reshape(-1)  # (B,)


def unmasked_estimator(inputs: AdvantageInputs, config: AdvantageConfig):
    """Broadcasts the score to every position, padding included."""
    adv = _group_centered(inputs, False)[:, None].expand_as(inputs.action_mask).clone()  # (B, A)
    return adv, adv


def nan_on_constant_group(inputs: AdvantageInputs, config: AdvantageConfig):
    adv = _group_centered(inputs, True)[:, None] * inputs.action_mask  # (B, A)
    return adv, adv


def interleaved_groups(inputs: AdvantageInputs, config: AdvantageConfig):
    """Reads groups as rows i, i+G, i+2G (interleaved), not contiguous blocks."""
    rewards = inputs.rewards.view(inputs.group_size, -1)  # (n, G): wrong layout
    adv = (rewards - rewards.mean(dim=0, keepdim=True)).reshape(-1)[:, None] * inputs.action_mask
    return adv, adv


def ignores_sample_mask(inputs: AdvantageInputs, config: AdvantageConfig):
    adv = _group_centered(inputs, False)[:, None] * inputs.action_mask
    return adv, adv


def unmasked_policy_loss(inputs, config):
    return -(inputs.logprobs - inputs.old_logprobs).exp() * inputs.advantages, {}


def detached_policy_loss(inputs, config):
    ratio = (inputs.logprobs.detach() - inputs.old_logprobs).exp()
    return -ratio * inputs.advantages * inputs.loss_mask, {}


def batch_normalised_policy_loss(inputs, config):
    """Divides by a batch statistic, so a row's loss depends on the other rows."""
    loss = -(inputs.logprobs - inputs.old_logprobs).exp() * inputs.advantages * inputs.loss_mask
    return loss / inputs.loss_mask.sum(), {"policy/mean": loss.mean().item()}


def shifted_kl(logprobs, ref_logprobs):
    return logprobs - ref_logprobs + 0.1


def micro_batch_token_mean(loss, action_mask, norm):
    """Divides by this micro-batch's tokens, not the step's."""
    return (loss * action_mask).sum() / action_mask.sum()


def short_reward(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def nan_reward(completions, **kwargs):
    return [float("nan")] * len(completions)


async def async_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


class ExportsNothing(ModelAdapterBase):
    """Loads the hf way but saves only the tokenizer."""

    def __init__(self, config=None):
        pass

    def load_tokenizer(self, ref):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(ref)

    def load(self, ref, *, role):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
        if role == "reference":
            model.requires_grad_(False)
        return model

    def save(self, model, tokenizer, out_dir):
        tokenizer.save_pretrained(out_dir)


class _Backend:
    shards_weights = False
    shards_state = False

    def __init__(self, model, config=None):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @property
    def train_module(self):
        return self.model

    def backward(self, loss):
        loss.backward()

    def step(self):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0).item()
        skipped = not torch.isfinite(torch.tensor(norm))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad()
        return {"grad_norm": norm, "lr": 1e-2, "skipped": float(skipped), "n": len(grads)}

    def zero_grad(self):
        self.optimizer.zero_grad()

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])

    def save_checkpoint(self, directory):
        raise NotImplementedError

    def load_checkpoint(self, directory):
        raise NotImplementedError

    def full_weights(self):
        import contextlib

        return contextlib.nullcontext()


class GoodBackend(_Backend):
    """A plain AdamW backend that keeps the contract (control for the broken ones)."""


class StepChangesNothing(_Backend):
    def step(self):
        self.optimizer.zero_grad()
        return {"grad_norm": 1.0, "lr": 1e-2, "skipped": 0.0}


class ForgetsOptimizerState(_Backend):
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class OneSampleShort:
    """Returns one completion fewer than asked for."""

    shares_weights = True

    def __init__(self, model, tokenizer, config=None):
        self.model = model

    def generate(self, prompts, *, n, params):
        from rlhf.api import Generation

        return [Generation(token_ids=[7], finish_reason="length", logprobs=[-1.0]) for _ in range(len(prompts) * n - 1)]

    def load_weights(self, state=None):
        pass


class IgnoresStop(OneSampleShort):
    """Writes a fixed text with spaces and never stops at a stop string."""

    def __init__(self, model, tokenizer, config=None):
        self.ids = tokenizer("a b c d", add_special_tokens=False)["input_ids"]

    def generate(self, prompts, *, n, params):
        from rlhf.api import Generation

        ids = self.ids[:params.max_new_tokens]
        return [Generation(token_ids=list(ids), finish_reason="length", logprobs=[-1.0] * len(ids))
                for _ in range(len(prompts) * n)]


class IgnoresSeeds:
    """A valid turn-batched engine whose continuous requests sample from the process's stream,
    whatever their seed (registered with ``continuous_batching=True``)."""

    shares_weights = True

    def __init__(self, model, tokenizer, config=None):
        from rlhf.plugins.engines.hf import HFEngine

        self.inner = HFEngine(model, tokenizer)

    def generate(self, prompts, *, n, params):
        return self.inner.generate(prompts, n=n, params=params)

    async def generate_one(self, prompt_ids, params):
        import dataclasses

        return self.inner.generate([prompt_ids], n=1, params=dataclasses.replace(params, seed=None))[0]

    def continuous_for(self, params):
        return True

    def load_weights(self, state=None):
        pass


class _ResponseNLL:
    """A small SFT objective on prompt/response rows, correct except where a subclass breaks it."""

    def __init__(self, config=None):
        self.config = config

    def columns(self):
        return ["prompt", "response"]

    def encode(self, row, text):
        return text.join(text.prompt_ids(text.prompt(row["prompt"])), text.ids(text.response(row["prompt"], row["response"])))

    def step_examples(self, examples):
        return examples

    def collate(self, examples, pad_token_id):
        width = max(len(ids) for ids, _ in examples)
        input_ids = torch.full((len(examples), width), pad_token_id)  # (B, T)
        mask = torch.zeros(len(examples), width - 1)  # (B, T-1)
        for i, (ids, prompt_len) in enumerate(examples):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            mask[i, prompt_len - 1:len(ids) - 1] = 1.0
        return {"input_ids": input_ids, "attention_mask": (input_ids != pad_token_id).long(), "mask": mask}

    def units(self, batch):
        return float(batch["mask"].sum())

    def step_statistics(self, models, batch):
        return None

    def token_nll(self, models, batch):
        logits = models.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])
        return -logprobs.squeeze(-1) * batch["mask"]  # (B, T-1)

    def loss(self, models, batch, stats):
        return self.token_nll(models, batch).sum() / batch["mask"].sum(), {}

    def final_statistics(self, models, batch):
        return None

    def output_config(self, stats):
        return {}


class GoodObjective(_ResponseNLL):
    """The control: keeps the contract."""


class SumsInsteadOfMeans(_ResponseNLL):
    """Returns the sum over the micro-batch, so the step gradient grows with the micro-batch size."""

    def loss(self, models, batch, stats):
        return self.token_nll(models, batch).sum(), {}


class DetachedLoss(_ResponseNLL):
    def loss(self, models, batch, stats):
        return (self.token_nll(models, batch).sum() / batch["mask"].sum()).detach(), {}
