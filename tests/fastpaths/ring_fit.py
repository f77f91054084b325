"""The training steps test_ring_training.py compares: one optimizer step of each offline objective
(the fit loop's own step) and of the RL policy (`PolicyWorker.fit`), on the recording backend
(plain SGD that keeps the gradient).

Run as a script under torchrun (2 ranks, gloo) it takes every step with ``--ring-attn-size 2``
(each rank's gradient summed over the ranks, as the backends sum them) and rank 0 saves them to
argv[4]; the test takes the same steps in one process by importing `take_step`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

CASES = [(command, packing) for command in ("sft", "dpo", "kto", "rm", "rl") for packing in (False, True)] + \
    [("prm", False), ("distill", False)]  # these two call the model directly: whole logits gathered
COMMAND_OPTIONS = {"sft": {"data": "sft.jsonl"}, "dpo": {"data": "pairs.jsonl", "objective.beta": 0.5},
                   "kto": {"data": "kto.jsonl", "objective.output_key": "completion"}, "rm": {"data": "pairs.jsonl"},
                   "prm": {"data": "steps.jsonl", "objective.placeholder_token": "@",
                           "objective.reward_tokens": ["+", "-"]},
                   "distill": {"data": "sft.jsonl"}}


def recording_plugins() -> Any:
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from tests.runtime.recording import recording_plugin

    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.register(recording_plugin())
    return plugins


def fit_step(command: str, packing: bool, model_dir: str, data_dir: str, out: Path, dist: Any,
             teacher: str) -> dict[str, Any]:
    """One step of ``rlhf <command>`` (4 examples, micro-batches of 2) through the fit loop."""
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.fit.local import build_parts
    from rlhf.runtime.fit.loop import FitLoop
    from rlhf.runtime.config.fit_plan import FitPlan
    from tests.runtime.recording import RecordingBackend

    plugins = recording_plugins()
    options = dict(COMMAND_OPTIONS[command])
    values = {"model": model_dir, "data": [str(Path(data_dir) / options.pop("data"))], "objective": command,
              "batch_size": 4, "micro_batch_size": 2, "steps": 1, "lr": 0.1, "backend": "recording",
              "out": str(out), "progress": False, "packing": packing,
              "ring_attn_size": dist.ring.size if dist.ring is not None else 1, **options}
    if command == "distill":
        values["teacher"] = teacher
    config = FitConfig.from_dict(values, plugins)
    config.check()
    parts, plan = build_parts(FitPlan.make(config, plugins), dist)
    RecordingBackend.clear()
    metrics = FitLoop(plan, plugins, parts).step(0)
    return {"grads": RecordingBackend.steps[0], "loss": metrics["train/loss"]}


def rl_step(packing: bool, model_dir: str, dist: Any) -> dict[str, Any]:
    """`PolicyWorker.fit` of GRPO (with entropy) on a fixed batch: old log-probs, one optimizer step."""
    from transformers import AutoModelForCausalLM

    from rlhf.algorithms import compute_advantages, resolve_algorithm
    from rlhf.core.batch import collate
    from rlhf.core.types import Trajectory
    from rlhf.runtime.rl.workers import PolicyWorker
    from rlhf.runtime.step.micro_batches import UpdateSettings
    from tests.runtime.recording import RecordingBackend

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
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0)
    batch.advantages, batch.returns = compute_advantages(algo.advantage, rewards=batch.rewards,
                                                         action_mask=batch.action_mask, group_size=2)
    settings = UpdateSettings(ppo_epochs=1, train_batch_size=8, micro_batch_size=2, max_new_tokens=8, packing=packing)
    training_loss = algo.policy_training_loss(None, entropy_coef=0.01)
    RecordingBackend.clear()
    worker = PolicyWorker(model, RecordingBackend(model, lr=0.1), settings, training_loss, dist)
    batch.old_logprobs = worker.logprobs(batch)
    metrics = worker.fit(batch, step=0)
    return {"grads": RecordingBackend.steps[0], "loss": metrics["policy/loss"],
            "old": batch.old_logprobs * batch.action_mask}  # (B, A) what training reads of them


def take_step(command: str, packing: bool, model_dir: str, data_dir: str, teacher: str, out: Path,
              dist: Any) -> dict[str, Any]:
    """The step's gradient (summed over the ranks), loss metric (and old log-probs for RL)."""
    import torch.distributed

    result = rl_step(packing, model_dir, dist) if command == "rl" else \
        fit_step(command, packing, model_dir, data_dir, out, dist, teacher)
    if dist.active:
        for grad in result["grads"].values():
            torch.distributed.all_reduce(grad)
    return result


def main(model_dir: str, data_dir: str, teacher: str, out: str) -> None:
    from rlhf.core.distributed import exit_process, init_from_environment

    dist = init_from_environment("gloo").with_rings(2)
    results = {f"{command}/{'packed' if packing else 'padded'}":
               take_step(command, packing, model_dir, data_dir, teacher, Path(out).parent / f"{command}-{packing}",
                         dist)
               for command, packing in CASES}
    if dist.is_main:
        torch.save(results, out)
    dist.close()
    exit_process(0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.runtime.recording`
    main(*sys.argv[1:5])
