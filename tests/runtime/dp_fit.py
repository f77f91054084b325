"""Run by tests/runtime/test_data_parallel.py under torchrun: one PolicyWorker.fit on a fixed batch.

Every rank builds the same model and batch; the main rank saves the updated weights to argv[2].
With argv[3] = "nan", row 5 gets a NaN advantage: only the rank that trains row 5 sees a NaN loss.
"""

import sys

import torch

from rlhf.algorithms import resolve_algorithm
from rlhf.core.types import Trajectory
from rlhf.plugins.backends.torch_backend import BackendConfig, TorchBackend
from rlhf.core.batch import collate
from rlhf.core.distributed import exit_process, init_from_environment
from rlhf.runtime.rl.workers import PolicyWorker
from rlhf.runtime.step.micro_batches import UpdateSettings


def main(model_dir: str, out: str, poison: str = "") -> None:
    from transformers import AutoModelForCausalLM

    dist = init_from_environment("gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(1)
    trajectories = []
    for row in range(8):  # 4 prompts x 2 samples of different lengths
        prompt = torch.randint(5, 300, (3 + row % 3,), generator=generator).tolist()
        completion = torch.randint(5, 300, (2 + row % 4,), generator=generator).tolist()
        trajectories.append(Trajectory(token_ids=prompt + completion, loss_mask=[0] * len(prompt) + [1] * len(completion),
                                       prompt_length=len(prompt), prompt="", prompt_text="", completion_text="",
                                       group=row // 2))
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.5])
    batch = collate(trajectories, pad_token_id=0, rewards=rewards, sample_mask=torch.ones(8))
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0)
    from rlhf.algorithms import compute_advantages

    advantages, returns = compute_advantages(algo.advantage, rewards=batch.rewards, action_mask=batch.action_mask,
                                             group_size=2)
    if poison == "nan":
        advantages[5] = float("nan")  # (A,): row 5 is trained by rank 1 of 2
    batch.advantages, batch.returns = advantages, returns
    settings = UpdateSettings(ppo_epochs=2, train_batch_size=4, micro_batch_size=1, max_new_tokens=8, seed=3)
    training_loss = algo.policy_training_loss(None)
    worker = PolicyWorker(model, TorchBackend(model, BackendConfig(lr=1e-2)), settings, training_loss, dist)
    batch.old_logprobs = worker.logprobs(batch)
    metrics = worker.fit(batch, step=0)
    if dist.is_main:
        torch.save({"weights": model.state_dict(), "metrics": metrics, "old": batch.old_logprobs}, out)
    dist.close()
    exit_process(0)  # as rlhf commands under a launcher do


if __name__ == "__main__":
    main(*sys.argv[1:])
