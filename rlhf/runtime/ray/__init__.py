"""The Ray runtime (docs/architecture.md): the local runtime's workers as Ray actors, the same trainer loop.

``rlhf train --runtime ray ...`` (or `train` here) places the roles (policy, reference, critic,
rollout, reward) in actor groups with their own resources (placement.py), builds each role
inside its actor with the local runtime's builders (actors.py), and runs
`rlhf.runtime.rl.trainer.Trainer` in the driver with group handles in place of the local workers
(groups.py). Data-parallel policy (and reference, critic) actors form a torch.distributed group
and follow the launcher scheme of rlhf/core/distributed.py, so ``token_mean`` and the other
aggregations normalise over the whole minibatch across actors.

Weights: rollout actors hold their own copy of the policy and receive policy rank 0's trainable
parameters after every step (``time/sync``): through the object store, or with ``--weight-sync
broadcast`` over a process group of policy rank 0 and the rollout actors
(rlhf/runtime/ray/weight_broadcast.py); with ``--colocate all`` the engine reads the policy's own
weights and nothing travels.

With ``--agent`` (docs/agents.md) each rollout actor builds the agent endpoint in front of its engine,
as the local process does, and runs the agent calls of the trajectories it rolls out; they come back
with the rest of its trajectories. A retry (``--on-failure retry``) samples from its own seed inside
the rollout actor (`RolloutGroup.generate_seeded`), leaving the actor's stream as the local process's.

Parity with the local runtime: the same seed and config give the same samples, rewards, losses
and weights (tests/ray: GRPO on the tiny model with separate actors, PPO with a critic actor,
PPO with both pairs colocated (``--colocate policy_ref --colocate critic_reward``), GRPO with
policy+reference colocated across a kill and a resume, and with the policy and the rollout on
two nodes of one cluster (``--ray-place``), an agent calling a tool, failing, retried, and under
``--async`` (tests/ray/test_agents_ray.py); checked by hand with LoRA and with
``--colocate all``). Each actor seeds itself as the local process does and builds its roles
in the local order; the critic's value head draws from ``seed`` itself, and sampling re-seeds
after the builds in both runtimes, so the rollout actor samples what the local process samples.
The scope:

* one rollout worker. With N, worker r takes every N-th prompt and samples from ``seed + r``:
  deterministic, but other tokens than one process draws (a local run with N torchrun ranks
  samples like N rollout workers);
* no dropout in training (it draws from the policy actor's stream, not the sampling one);
* equal thread counts. A Ray actor gets as many threads as CPUs (one for a fraction); a local
  process with more threads sums floats in another order (differences in the last bits, which
  the tests tolerate at 1e-5 relative).

Data parallelism changes the order of float sums too: two policy actors match one to ~1e-6.

Checkpoints are the local runtime's plus each rollout actor's RNG states (``rollout/``), so a
resumed Ray run samples what the uninterrupted run would have. Actors write their own state:
on a multi-node cluster ``--out`` must be on a filesystem every node sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf.core.plugin_host.loading import PluginSet
    from rlhf.runtime.config.train_config import TrainConfig


def train(config: TrainConfig, *, plugins: PluginSet | None = None) -> Path:
    """Run training with the Ray runtime; returns the run directory."""
    from rlhf.runtime.ray.driver import train as run

    return run(config, plugins=plugins)
