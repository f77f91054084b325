"""The embedded local runtime: every worker in this process, on one device (CPU or one GPU).

`train(config)` is what ``rlhf train`` calls; tests and notebooks call it directly too. Started
by a launcher (``torchrun --nproc-per-node N -m rlhf train ...``), each process is one
data-parallel rank running the same loop (rlhf/core/distributed.py), with roles that share the
prompts out over the ranks and score on the main rank (rlhf/runtime/rl/ranks.py).

The role builders below are shared with the Ray runtime, which calls each inside the actor that
holds the role, in the same order (so the same random numbers are drawn).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf.core.distributed import SINGLE, DistContext, init_from_environment
from rlhf.core.errors import ConfigError, PluginError
from rlhf.core.offload import shares_parameters
from rlhf.core.plugin_host.loading import PluginSet, build_plugin_manager
from rlhf.core.protocols.rollout import SamplingParams, batches_continuously
from rlhf.runtime.rl.async_generation import AsyncParts
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.run.data import DataSettings, PromptFormatter, PromptLoader, load_prompts
from rlhf.fastpaths.ring_attention import check_model as check_ring_model
from rlhf.runtime.run.export import export_critic, export_model
from rlhf.runtime.config.train_plan import RunPlan
from rlhf.runtime.run.prompt_format import PromptFormat
from rlhf.runtime.rl.ranks import on_ranks
from rlhf.runtime.rl.rollout import EnvFactory, RolloutSettings, RolloutWorker
from rlhf.runtime.rl.scoring import Scoring
from rlhf.runtime.run.lifecycle import seed_everything, start_run
from rlhf.runtime.step.router_aux import RouterAux
from rlhf.runtime.rl.trainer import Trainer, Workers
from rlhf.runtime.rl.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker
from rlhf.runtime.step.micro_batches import UpdateSettings

log = logging.getLogger(__name__)


def sampling_seed(seed: int, rank: int) -> int:
    """The seed rank ``rank`` samples with once its models are built (rank 0: ``seed`` again): ranks
    given the same prompt draw different completions; the same rank draws the same ones every run.
    The Ray runtime re-seeds its rollout ranks the same way, so one rollout actor samples exactly
    what the local process samples whichever roles each of them built."""
    return seed + rank


# --- one builder per role -------------------------------------------------------------------


def update_settings(plan: RunPlan) -> UpdateSettings:
    config = plan.config
    return UpdateSettings(ppo_epochs=config.ppo_epochs, train_batch_size=plan.derived.train_batch_size,
                          micro_batch_size=config.micro_batch_size, max_new_tokens=config.max_new_tokens,
                          max_tokens_per_micro_batch=config.max_tokens_per_micro_batch, packing=config.packing,
                          share_prompt=config.share_prompt, seed=config.seed)


def build_adapter(plan: RunPlan) -> Any:
    return plan.choices["model_adapter"].load()(plan.component_config("model_adapter"))


def build_backend(plan: RunPlan, model: torch.nn.Module, lr: float) -> Any:
    """The backend of one trained model; its ``shards_weights`` must be what it registered, which the
    plan's checks (`RunPlan.check`) relied on before anything was built."""
    backend = plan.choices["backend"].load()(model, plan.component_config("backend", lr=lr))
    if bool(backend.shards_weights) != plan.shards_weights:
        raise PluginError(f"the {plan.choices['backend'].name!r} train backend's shards_weights is "
                          f"{bool(backend.shards_weights)} but its registration declares {plan.shards_weights}: "
                          "fix the plugin's shards_weights= in register_train_backends")
    return backend


def build_policy(plan: RunPlan, adapter: Any, dist: DistContext = SINGLE) -> PolicyWorker:
    config = plan.config
    model = adapter.load(config.model, role="policy")
    if dist.ring is not None:
        check_ring_model(model, dist.ring.head_stride)
    training_loss = plan.algorithm.policy_training_loss(plan.policy_loss_config, entropy_coef=config.entropy_coef,
                                                temperature=config.temperature,
                                                kl_unbiased_gradient=config.kl_unbiased_gradient)
    return PolicyWorker(model, build_backend(plan, model, config.lr), update_settings(plan), training_loss, dist,
                        router_aux=RouterAux.attach(model, config.aux_loss_coef, config.model))


def build_reference(plan: RunPlan, adapter: Any, dist: DistContext = SINGLE, *,
                    policy: torch.nn.Module | None = None) -> ReferenceWorker:
    """``policy``: the policy module of this process, if any. With ``--offload-ref-reward`` the
    reference leaves the device between uses, unless it is a view of the policy's own weights (LoRA's
    reference: the adapter switched off), which the policy needs."""
    return _frozen_scorer(plan, adapter, plan.config.model, dist, policy)


def check_teacher_tokenizer(plan: RunPlan, adapter: Any, tokenizer: Any) -> None:
    """``--teacher`` must tokenize as the policy does (the teacher scores the student's token ids):
    the same vocabulary (every token string to the same id) and the same special tokens. Checked
    on the tokenizers alone, before any weights load; a usage error naming the first difference."""
    config = plan.config
    if not config.teacher:
        return
    teacher = adapter.load_tokenizer(config.teacher)
    problem = tokenizer_difference(tokenizer, teacher)
    if problem:
        raise ConfigError(f"--teacher {config.teacher} does not share the policy's tokenizer ({problem}): on-policy "
                          "distillation scores the student's token ids with the teacher, so pick a teacher of the "
                          "same tokenizer family")


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """What first differs between two tokenizers' vocabularies and special tokens (None: nothing)."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        moved = sorted(t for t in mine.keys() & theirs.keys() if mine[t] != theirs[t])
        only = sorted(mine.keys() ^ theirs.keys())
        if moved:
            return f"token {moved[0]!r} is id {mine[moved[0]]} for the policy, {theirs[moved[0]]} for the teacher"
        return (f"vocabulary of {len(mine)} tokens against {len(theirs)}"
                + (f", {only[0]!r} in one only" if only else ""))
    for name in ("bos_token", "eos_token", "unk_token"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return f"{name} {getattr(student, name, None)!r} against {getattr(teacher, name, None)!r}"
    specials = (sorted(map(str, student.all_special_tokens)), sorted(map(str, teacher.all_special_tokens)))
    if specials[0] != specials[1]:
        return f"special tokens {specials[0]} against {specials[1]}"
    return None


def build_teacher(plan: RunPlan, adapter: Any, dist: DistContext = SINGLE, *,
                  policy: torch.nn.Module | None = None) -> ReferenceWorker:
    """``--teacher``: a frozen model scoring the batch's tokens as the reference does (the same
    worker class: micro-batched, packed, vocabulary chunks, at the sampling temperature). Loaded as a
    reference model of its own directory: under LoRA a full frozen copy, unless it is the policy's
    own base (then the policy with its adapter switched off, never offloaded: ``policy`` as in
    `build_reference`)."""
    return _frozen_scorer(plan, adapter, plan.config.teacher, dist, policy)


def _frozen_scorer(plan: RunPlan, adapter: Any, directory: str, dist: DistContext,
                   policy: torch.nn.Module | None) -> ReferenceWorker:
    """The model at ``directory`` loaded as a reference, scoring tokens at the sampling temperature;
    offloaded with ``--offload-ref-reward`` unless it shares the policy's weights."""
    config = plan.config
    model = adapter.load(directory, role="reference")
    offload = config.offload_ref_reward and not (policy is not None and shares_parameters(model, policy))
    return ReferenceWorker(model, config.micro_batch_size, config.temperature, dist,
                           max_tokens_per_micro_batch=config.max_tokens_per_micro_batch, packing=config.packing,
                           share_prompt=config.share_prompt, offload=offload)


def build_critic(plan: RunPlan, adapter: Any, dist: DistContext = SINGLE) -> CriticWorker:
    """Its new value head draws from ``seed`` itself, whatever was built before it in this process
    (the Ray runtime builds the critic in an actor of its own: the same head either way)."""
    config = plan.config
    seed_everything(config.seed)
    model = adapter.load(config.critic_model or config.model, role="critic")
    return CriticWorker(model, build_backend(plan, model, config.critic_lr), update_settings(plan),
                        plan.algorithm.value_training_loss(config.value_clip), dist)


def build_rollout(plan: RunPlan, plugins: PluginSet, model: torch.nn.Module, tokenizer: Any, *,
                  synced_generation: bool = False, trained: Sequence[Any] = ()) -> RolloutWorker:
    """``synced_generation``: ``model`` is a trained policy whose forwards are collectives over its
    ranks (a backend that ``shards_weights``, e.g. DeepSpeed ZeRO-3), so ranks decode in lockstep.
    ``trained``: the trained workers of this process (policy, critic), whose training state leaves
    the device while the engine generates with ``--offload-train-state``."""
    config = plan.config
    engine_config = plan.component_config("engine", synced_generation=synced_generation)
    engine = plan.choices["engine"].load()(model, tokenizer, engine_config)
    envs = EnvFactory(plugins.registry("env"), plan.env_settings, plan.run_values())
    envs.capabilities(config.env)  # the run's environment resolved (and its settings checked) once, before step 1
    set_aside = [worker.backend for worker in trained if worker is not None] if config.offload_train_state else []
    continuous = plan.choices["engine"].capabilities["continuous_batching"]
    return RolloutWorker(engine, tokenizer, envs, RolloutSettings(env=config.env, max_turns=config.max_turns,
                                                                  max_total_tokens=plan.token_budget,
                                                                  env_timeout_s=config.env_timeout_s),
                         set_aside=set_aside, continuous_batching=continuous,
                         agents=build_agents(plan, engine, tokenizer, continuous) if config.agent else None)


def build_agents(plan: RunPlan, engine: Any, tokenizer: Any, continuous: bool) -> Any:
    """``--agent``: the endpoint in front of ``engine`` and the rollout that calls the agent
    (`rlhf.runtime.agents`); the endpoint starts with the first rollout."""
    from rlhf.runtime.agents.calling import AgentCaller
    from rlhf.runtime.agents.endpoint import AgentEndpoint
    from rlhf.runtime.agents.requests import RunSampling
    from rlhf.runtime.agents.rollout import AgentRollout, AgentSettings

    config = plan.config
    run = RunSampling(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                      repetition_penalty=config.repetition_penalty, max_new_tokens=config.max_new_tokens,
                      max_total_tokens=plan.token_budget)
    params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                            top_p=config.top_p, top_k=config.top_k, repetition_penalty=config.repetition_penalty)
    endpoint = AgentEndpoint(engine, tokenizer, plan.choices["tool_parser"].load(), run, model_name=config.model,
                             continuous=batches_continuously(engine, params, declared=continuous))
    agent = plan.choices["agent"]
    caller = AgentCaller(agent.load(), plan.component_config("agent"), agent.name)
    return AgentRollout(endpoint, caller, tokenizer, AgentSettings(name=agent.name, input_key=config.input_key,
                                                                   has_reward_sources=bool(config.reward)))


def build_reward(config: TrainConfig, plugins: PluginSet) -> RewardWorker:
    """The reward sources (none when the environment gives every reward)."""
    from rlhf.rewards import load_rewards

    if not config.reward:
        return RewardWorker(None)
    options = dataclasses.asdict(config.reward_options)
    rewards = load_rewards(config.reward, plugins=plugins, on_error=options.pop("on_error"), **options)
    rewards.check_labels_given(config.label_key)
    if config.offload_ref_reward:
        rewards.offload_between_uses()
    return RewardWorker(rewards)


def data_settings(config: TrainConfig) -> DataSettings:
    return DataSettings(paths=config.data, input_key=config.input_key, label_key=config.label_key,
                        allow_missing_labels=config.allow_missing_labels,
                        probs=config.mixing_probs,
                        split=config.data_split, apply_chat_template=config.apply_chat_template,
                        input_template=config.input_template, max_prompt_length=config.max_prompt_length,
                        max_samples=config.max_samples, seed=config.seed)


def build_loader(config: TrainConfig, tokenizer: Any) -> PromptLoader:
    settings = data_settings(config)
    return PromptLoader(load_prompts(settings), PromptFormatter(tokenizer, settings), seed=config.seed)


def build_eval_prompts(config: TrainConfig, tokenizer: Any) -> list[Any] | None:
    """The --eval-data prompts, formatted like the training prompts (None without --eval-data)."""
    if not config.eval_data:
        return None
    settings = dataclasses.replace(data_settings(config), paths=list(config.eval_data), probs=None,
                                   max_samples=config.eval_max_samples)
    dataset, formatter = load_prompts(settings), PromptFormatter(tokenizer, settings)
    return [formatter(dataset[i]) for i in range(len(dataset))]


def export_final(plan: RunPlan, adapter: Any, tokenizer: Any, policy: Any, critic: Any, out_dir: Path,
                 dist: DistContext = SINGLE, critic_dir: Path | None = None) -> None:
    """The final policy to ``out_dir`` and, with ``--save-critic``, the critic to ``critic_dir``
    (default ``<out>/critic``)."""
    export_model(adapter, tokenizer, policy, out_dir, dist, prompt_format=PromptFormat.of(plan.config))
    if critic is not None and plan.config.save_critic:
        export_critic(adapter, tokenizer, critic, critic_dir or plan.derived.out_dir / "critic", dist)


class LocalPolicyCopy:
    """--async in this process: a deep copy of the policy module with a rollout of its own; sampling
    draws from the process's random stream (the trainer draws none while the producer runs)."""

    evaluates_here = False  # eval samples with the trainer's own rollout, on the newest weights

    def __init__(self, plan: RunPlan, policy: PolicyWorker, make_rollout: Any):
        import copy

        self.seed, self.policy = plan.config.seed, policy
        # never trained: eval mode for good (its engine's decoding and its log-probs, which may run on
        # several threads at once with --partial-rollouts, then never switch it back and forth)
        self.model = copy.deepcopy(policy.model).eval()
        self.rollout = make_rollout(self.model)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def close(self) -> None:
        """Stop what the copy's rollout started (``--agent``: its endpoint, which serves this copy)."""
        self.rollout.close()

    def logprobs(self, batch: Any) -> torch.Tensor:
        return self.policy.logprobs_under(self.model, batch)

    def swap_rng(self, states: list[torch.Tensor] | None) -> list[torch.Tensor]:
        previous = [torch.get_rng_state()]
        fresh = torch.Generator().manual_seed(self.seed + 1_000_003).get_state()
        torch.set_rng_state(states[0] if states is not None else fresh)
        return previous


def build_workers(plan: RunPlan, plugins: PluginSet, dist: DistContext = SINGLE) -> tuple[Workers, RunPlan]:
    """Every role in this process, and the plan completed with the data's size."""
    config = plan.config
    seed_everything(config.seed)
    reward = build_reward(config, plugins)
    adapter = build_adapter(plan)
    tokenizer = adapter.load_tokenizer(config.tokenizer or config.model)
    check_teacher_tokenizer(plan, adapter, tokenizer)
    loader = build_loader(config, tokenizer)
    plan = plan.with_prompts(len(loader))

    policy = build_policy(plan, adapter, dist)
    reference = build_reference(plan, adapter, dist, policy=policy.model) if plan.algorithm.needs_reference else None
    teacher = build_teacher(plan, adapter, dist, policy=policy.model) if config.teacher else None
    critic = build_critic(plan, adapter, dist) if plan.algorithm.needs_critic else None
    rollout = build_rollout(plan, plugins, policy.model, tokenizer,
                            synced_generation=policy.backend.shards_weights and dist.active, trained=(policy, critic))
    # Sampling starts from its own seed, whatever the builds drew (as in the Ray rollout actors), and
    # every rank (same initial weights, from one seed) samples apart from the others.
    seed_everything(sampling_seed(config.seed, dist.rank))
    scoring = Scoring(plan, plugins, reward) if dist.is_main else None  # the others take the main rank's verdict
    workers = Workers(
        policy=policy, rollout=rollout, reward=reward, scoring=scoring, reference=reference, teacher=teacher,
        critic=critic,
        loader=loader, pad_token_id=tokenizer.pad_token_id, dist=dist, policy_here=not dist.active,
        eval_prompts=build_eval_prompts(config, tokenizer),
        async_parts=AsyncParts(snapshot=lambda: {k: v.detach().clone() for k, v in policy.model.state_dict().items()},
                         make_copy=lambda: LocalPolicyCopy(plan, policy, lambda m: build_rollout(plan, plugins, m,
                                                                                                    tokenizer)),
                         # lanes copy the policy module: only for engines that sample from it in place;
                         # an agent's rollout, like a multi-turn one, draws only its seed (each lane's copy
                         # serves its trajectories through an endpoint of its own)
                         rollouts_overlap=(bool(config.agent) or config.max_turns > 1
                                           and plan.env_capability("multi_turn"))
                         and rollout.engine.shares_weights
                         and batches_continuously(rollout.engine, SamplingParams(max_new_tokens=config.max_new_tokens),
                                                  declared=rollout.continuous_batching),
                         # partial rollouts: every live version a copy of its own, its engine loading the
                         # copy's weights (in place, or through its weight sync: vllm)
                         partial_capable=rollout.agents is None
                         and batches_continuously(rollout.engine, SamplingParams(max_new_tokens=config.max_new_tokens),
                                                  declared=rollout.continuous_batching)),
        export=lambda out_dir, critic_dir: export_final(plan, adapter, tokenizer, policy, critic, out_dir, dist,
                                                        critic_dir),
    )
    return (on_ranks(workers) if dist.active else workers), plan


def train(config: TrainConfig, *, plugins: PluginSet | None = None) -> Path:
    """Run training with the local runtime; returns the run directory."""
    plugins = plugins or build_plugin_manager()
    plan = RunPlan.make(config, plugins)
    dist = init_from_environment().with_rings(config.ring_attn_size, config.ring_head_stride)
    workers, lock = None, None
    try:
        lock = start_run(plan, plugins, world_size=dist.dp_size, is_main=dist.is_main)
        workers, plan = build_workers(plan, plugins, dist)
        return Trainer(plan, plugins, workers).run()
    finally:
        close = getattr(getattr(workers, "rollout", None), "close", None)
        if close is not None:
            close()  # the agent endpoint, if the rollout started one
        del workers  # the models and their backends (which hold process groups) go before the group does
        dist.close()
        if lock is not None:
            lock.release()
