"""A training backend for tests: plain SGD that keeps every optimizer step's gradient and the
weights it was taken at.

Registered as ``recording`` by `recording_plugin`, it lets a test run the real training path
(``rlhf train`` or a worker's ``fit``) and compare the gradient it produced with one computed
independently from the formula, or recompute a later step's loss from the weights the loop
actually trained at that step.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

import rlhf
from rlhf.api import TrainBackendBase


class RecordingBackend(TrainBackendBase):
    steps: list[dict[str, torch.Tensor]] = []  # every instance's steps, in order: {parameter name: gradient}
    weights: list[dict[str, torch.Tensor]] = []  # the weights each of those gradients was taken at

    @classmethod
    def clear(cls) -> None:
        cls.steps.clear()
        cls.weights.clear()

    def __init__(self, model: torch.nn.Module, config: Any = None, lr: float = 0.0):
        super().__init__(model)
        self.lr = lr if config is None else config.lr
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        grads = {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                 for name, p in self.params.items()}
        RecordingBackend.steps.append(grads)
        RecordingBackend.weights.append({name: p.detach().clone() for name, p in self.params.items()})
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        with torch.no_grad():
            for name, p in self.params.items():
                p -= self.lr * grads[name]
                p.grad = None
        return {"grad_norm": norm, "lr": self.lr, "skipped": 0.0}

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def recording_plugin() -> types.ModuleType:
    from rlhf.plugins.backends.config import BackendConfig

    module = types.ModuleType("recording_backend_plugin")

    def register_train_backends(register):
        register("recording", RecordingBackend, config_cls=BackendConfig)

    module.register_train_backends = rlhf.hookimpl(register_train_backends)
    return module


def policy_step(model, batch, *, share, micro_batch_size=4, ppo_epochs=1, train_batch_size=None):
    """One GRPO policy update of ``batch`` on the recording backend (``share``: prefix sharing):
    (the gradients of its optimizer steps, its metrics, the log-probs before it)."""
    from rlhf.algorithms import resolve_algorithm
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.rl.workers import PolicyWorker
    from rlhf.runtime.step.micro_batches import UpdateSettings

    RecordingBackend.steps.clear()
    settings = UpdateSettings(train_batch_size=train_batch_size or batch.size, micro_batch_size=micro_batch_size,
                              max_new_tokens=8, share_prompt=share, ppo_epochs=ppo_epochs)
    algo = resolve_algorithm("grpo", n_samples=3, kl_coef=0.0, plugins=build_plugin_manager(load_entrypoints=False))
    worker = PolicyWorker(model, RecordingBackend(model), settings, algo.policy_training_loss(None, entropy_coef=0.05))
    logprobs = worker.logprobs(batch)
    batch.old_logprobs = logprobs
    metrics = worker.fit(batch, step=0)
    return list(RecordingBackend.steps), metrics, logprobs
