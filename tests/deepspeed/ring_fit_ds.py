"""Run by test_ring_deepspeed.py under torchrun: the RL policy update (packed) on DeepSpeed, per ZeRO
stage, with ``--ring-attn-size`` argv[3] (1: plain). The main rank saves, per stage, the fit
metrics and the updated weights (gathered under ZeRO-3) to argv[2]."""

import sys
from pathlib import Path

import torch

from rlhf.algorithms import compute_advantages, resolve_algorithm
from rlhf.core.distributed import exit_process, init_from_environment
from rlhf.plugins.backends.deepspeed_backend import DeepSpeedBackend, DeepSpeedConfig
from rlhf.runtime.rl.workers import PolicyWorker
from rlhf.runtime.step.micro_batches import UpdateSettings


def fit(model_dir: str, stage: int, dist) -> dict:
    from transformers import AutoModelForCausalLM

    from tests.deepspeed.dp_fit import fixed_batch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = fixed_batch()
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0)
    batch.advantages, batch.returns = compute_advantages(algo.advantage, rewards=batch.rewards,
                                                         action_mask=batch.action_mask, group_size=2)
    settings = UpdateSettings(ppo_epochs=1, train_batch_size=8, micro_batch_size=2, max_new_tokens=8, packing=True)
    backend = DeepSpeedBackend(model, DeepSpeedConfig(lr=1e-2, zero_stage=stage, micro_batch_size=2))
    worker = PolicyWorker(model, backend, settings, algo.policy_training_loss(None), dist)
    batch.old_logprobs = worker.logprobs(batch)
    metrics = worker.fit(batch, step=0)
    with backend.full_weights():
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"weights": weights, "metrics": metrics}


def main(model_dir: str, out: str, ring: str) -> None:
    dist = init_from_environment("gloo").with_rings(int(ring))
    results = {stage: fit(model_dir, stage, dist) for stage in (2, 3)}
    if dist.is_main:
        torch.save(results, out)
    dist.close()
    exit_process(0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.deepspeed.dp_fit`
    main(*sys.argv[1:4])
