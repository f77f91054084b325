"""Run by test_deepspeed.py under torchrun: one PolicyWorker.fit per ZeRO stage on a fixed batch.

Every rank builds the same model and batch; the main rank saves, per stage, the updated weights
(gathered under ZeRO-3), the fit metrics and the old log-probs to argv[2].
"""

import sys

import torch

from rlhf.algorithms import compute_advantages, resolve_algorithm
from rlhf.core.types import Trajectory
from rlhf.plugins.backends.deepspeed_backend import DeepSpeedBackend, DeepSpeedConfig
from rlhf.core.batch import collate
from rlhf.core.distributed import exit_process, init_from_environment
from rlhf.runtime.rl.workers import PolicyWorker
from rlhf.runtime.step.micro_batches import UpdateSettings


def fixed_batch():
    generator = torch.Generator().manual_seed(1)
    trajectories = []
    for row in range(8):  # 4 prompts x 2 samples of different lengths
        prompt = torch.randint(5, 300, (3 + row % 3,), generator=generator).tolist()
        completion = torch.randint(5, 300, (2 + row % 4,), generator=generator).tolist()
        trajectories.append(Trajectory(token_ids=prompt + completion,
                                       loss_mask=[0] * len(prompt) + [1] * len(completion),
                                       prompt_length=len(prompt), prompt="", prompt_text="", completion_text="",
                                       group=row // 2))
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.5])
    return collate(trajectories, pad_token_id=0, rewards=rewards, sample_mask=torch.ones(8))


def fit(model_dir: str, stage: int, dist) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = fixed_batch()
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0)
    batch.advantages, batch.returns = compute_advantages(algo.advantage, rewards=batch.rewards,
                                                         action_mask=batch.action_mask, group_size=2)
    settings = UpdateSettings(ppo_epochs=2, train_batch_size=4, micro_batch_size=1, max_new_tokens=8, seed=3)
    training_loss = algo.policy_training_loss(None)
    backend = DeepSpeedBackend(model, DeepSpeedConfig(lr=1e-2, zero_stage=stage, micro_batch_size=1))
    worker = PolicyWorker(model, backend, settings, training_loss, dist)
    batch.old_logprobs = worker.logprobs(batch)
    metrics = worker.fit(batch, step=0)
    with backend.full_weights():
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"weights": weights, "metrics": metrics, "old": batch.old_logprobs}


def main(model_dir: str, out: str, stages: str) -> None:
    dist = init_from_environment("gloo")
    results = {int(stage): fit(model_dir, int(stage), dist) for stage in stages.split(",")}
    if dist.is_main:
        torch.save(results, out)
    dist.close()
    exit_process(0)  # as rlhf commands under a launcher do


if __name__ == "__main__":
    main(*sys.argv[1:])
