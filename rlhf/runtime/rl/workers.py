"""The workers of a run as plain classes: policy, reference, critic, reward (rollout: rollout.py).

The local runtime calls them in-process; the Ray runtime wraps the same classes as actors.
Nothing here knows which: workers receive and return plain Python objects and CPU tensors.

Shape legend: ``B`` sequences, ``T`` tokens, ``A = T - 1`` action positions.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from rlhf.algorithms import PolicyTrainingLoss, ValueTrainingLoss, step_norm
from rlhf.core.batch import ExperienceBatch
from rlhf.core.distributed import SINGLE, DistContext
from rlhf.core.offload import ModuleOffload
from rlhf.core.types import LossNorm, Trajectory
from rlhf.core.rewards import RewardResult
from rlhf.rewards.combine import RewardSet
from rlhf.core.logprobs import known_logprob_gradient, token_logprobs, without_last_token
from rlhf.fastpaths.packing import is_packed
from rlhf.fastpaths.prefix_sharing import can_share, checked_for_sharing, share_prefixes, shared_token_logprobs
from rlhf.runtime.step.micro_batches import MicroBatch, UpdateSettings, minibatch_rows, my_rows, plan_micro_batches
from rlhf.runtime.step.router_aux import RouterAux
from rlhf.runtime.run.threads import adjust_threads
from rlhf.runtime.step.trained import TrainedModel, forward_model
from rlhf.runtime.step.weighted_means import WeightedMeans


# A micro-batch's share of the minibatch loss, its metrics and their weight (its loss tokens).
MicroLoss = Callable[["MicroBatch", LossNorm], tuple[torch.Tensor, dict[str, Any], float]]


def micro_logprobs(model: Any, micro: MicroBatch, *, temperature: float, with_entropy: bool = False,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of a micro-batch's rows under ``model`` (packed if it is a `PackedModel`),
    its prompts' forwards shared when it has ``groups`` and the model takes that."""
    batch = micro.batch
    input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    action_mask = batch.action_mask.to(device)

    def separate() -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs(model, input_ids, attention_mask, action_mask, temperature=temperature,
                              with_entropy=with_entropy)

    if micro.groups is None or is_packed(model) or not can_share(model):
        return separate()
    rows = share_prefixes(input_ids, without_last_token(attention_mask), micro.groups)

    def shared() -> tuple[torch.Tensor, torch.Tensor | None]:
        return shared_token_logprobs(model, rows, input_ids, action_mask, temperature=temperature,
                                     with_entropy=with_entropy)

    if checked_for_sharing(model, rows, lambda: shared()[0] * action_mask, lambda: separate()[0] * action_mask,
                           "train"):
        return shared()
    return separate()


def forward_rows(batch: ExperienceBatch, dist: DistContext, size: int,
                 compute: Callable[[MicroBatch], torch.Tensor], max_tokens: int | None = None,
                 packed: bool = False, share: bool = False) -> torch.Tensor:
    """``compute`` (a per-row (b, A') result) over this rank's rows in micro-batches
    (`plan_micro_batches`; prompts shared on one rank only), put back in row order and gathered to
    (B, A) on every rank."""
    mine = my_rows(batch, dist)
    out = torch.zeros((mine.size, batch.action_mask.shape[1]), dtype=torch.float32)  # (b, A)
    for micro in plan_micro_batches(mine, size, max_tokens, packed, share and not dist.active):
        result = compute(micro).cpu()  # (len(rows), A') trimmed to the micro-batch's length
        out[micro.rows, : result.shape[1]] = result
    return gather_rows(out, dist, batch.size)


def gather_rows(local: torch.Tensor, dist: DistContext, total: int) -> torch.Tensor:
    """Inverse of `my_rows` for a per-row result: (b, A) on each rank -> (B, A) on every rank."""
    if not dist.active:
        return local
    parts = dist.all_gather(local.cpu())
    width = max(p.shape[1] for p in parts)
    out = local.new_zeros((total, width)).cpu()  # (B, A)
    for rank, part in enumerate(parts):
        out[rank::dist.dp_size, : part.shape[1]] = part
    return out


@torch.no_grad()
def model_logprobs(model: torch.nn.Module, batch: ExperienceBatch, settings: UpdateSettings, *, temperature: float,
                   dist: DistContext = SINGLE) -> torch.Tensor:
    """(B, A) log-probs of a batch's tokens under ``model`` at the sampling temperature, in eval mode,
    micro-batched (and packed) as the policy's own forwards are (``settings``)."""
    device = next(model.parameters()).device
    forward = forward_model(model, packing=settings.packing, ring=dist.ring)
    was_training = model.training
    model.eval()
    try:
        return forward_rows(batch, dist, settings.micro_batch_size, lambda micro: micro_logprobs(
            forward, micro, temperature=temperature, device=device)[0], settings.max_tokens_per_micro_batch,
            settings.packing, settings.share_prompt)
    finally:
        model.train(was_training)


class _TrainedWorker(TrainedModel):
    """Shared by the policy and the critic: a trained model (`TrainedModel`) and its RL update loop."""

    def __init__(self, model: torch.nn.Module, backend: Any, settings: UpdateSettings, dist: DistContext = SINGLE):
        super().__init__(model, backend, dist)
        self.settings = settings

    def _forward_rows(self, batch: ExperienceBatch, compute: Callable[[MicroBatch], torch.Tensor]) -> torch.Tensor:
        settings = self.settings
        return forward_rows(batch, self.dist, settings.micro_batch_size, compute,
                            settings.max_tokens_per_micro_batch, settings.packing)

    def _my_micro_batches(self, minibatch: ExperienceBatch, share: bool) -> list[MicroBatch]:
        settings = self.settings
        return plan_micro_batches(my_rows(minibatch, self.dist), settings.micro_batch_size,
                                  settings.max_tokens_per_micro_batch, settings.packing,
                                  share and settings.share_prompt and not self.dist.active)

    def _packed(self, model: Any) -> Any:
        """``model`` as the log-prob forwards call it: packed with ``--packing``, over the ring with
        ``--ring-attn-size``."""
        return forward_model(model, packing=self.settings.packing, ring=self.dist.ring)

    def _fit(self, batch: ExperienceBatch, step: int, micro_loss: MicroLoss, share: bool = False,
             trained_rows: Callable[[ExperienceBatch], torch.Tensor | None] | None = None) -> WeightedMeans:
        """The update loop of every trained role: epochs over shuffled minibatches, one optimizer
        step per minibatch, gradients accumulated over this rank's micro-batches.

        ``micro_loss(micro, norm) -> (loss, metrics, weight)`` gives a micro-batch's share of the
        minibatch loss (normalised by minibatch-wide counts, so accumulation reproduces the
        full-batch gradient). ``trained_rows(minibatch)``: the rows that can add to the loss
        (`_rows_that_train`). A non-finite loss on any rank skips the step on every rank: each rank
        still runs all its forwards and backwards (collectives under DeepSpeed ZeRO), then the
        ranks agree on whether to step, as a rank stepping alone would wait forever in the gradient
        all-reduce.
        """
        adjust_threads()  # once a step: the CPU thread count follows the machine's load
        self.check_token_budget(self.settings.max_tokens_per_micro_batch)
        self.model.train()
        metrics = WeightedMeans()
        first = True  # no optimizer step of this step has run yet
        for rows in minibatch_rows(batch, self.settings, step):  # (b,) each
            minibatch = batch.select(rows)
            norm = step_norm(minibatch, self.settings.max_new_tokens)
            if norm.num_tokens == 0:
                continue
            minibatch, kept = self._rows_that_train(minibatch, trained_rows, share and self.settings.share_prompt,
                                                    metrics)
            rows = rows if kept is None else rows[kept]  # (b',) the minibatch's rows in the step's batch
            micros = self._my_micro_batches(minibatch, share)
            before = first and not self.dist.active
            self.optimizer_step([lambda micro=micro: micro_loss(MicroBatch(
                micro.rows, micro.batch.to(self.device), micro.groups,
                before_update=rows[micro.rows] if before else None), norm) for micro in micros], metrics)
            first = False
        return metrics

    def _rows_that_train(self, minibatch: ExperienceBatch, trained_rows: Callable[[ExperienceBatch], Any] | None,
                         whole_groups: bool, metrics: WeightedMeans) -> tuple[ExperienceBatch, torch.Tensor | None]:
        """The minibatch without the rows ``trained_rows`` says add exactly nothing to the loss and its
        gradient (zero advantages, `PolicyTrainingLoss.trained_rows`): their forwards and backwards are
        skipped, the step's counts (``norm``) still include them. ``whole_groups``: a row is
        skipped only with its prompt's other samples (shared forwards want whole groups). Metric
        ``zero_advantage_frac``: the share of the minibatch's rows that add nothing (whole groups
        with ``whole_groups``). They are skipped in one process only (under torchrun every rank
        runs the same number of micro-batches, and trains them all). When no row trains, one
        is kept: the optimizer then steps with zero gradients, as it would over the whole
        minibatch (momentum and weight decay still apply). Also returns the kept rows' indices in
        the minibatch (b',), None when all are kept."""
        keep = trained_rows(minibatch) if trained_rows is not None else None  # (b,)
        if keep is None:
            return minibatch, None
        if whole_groups:
            groups = minibatch.group_index  # (b,)
            alive = torch.zeros(int(groups.max()) + 1, dtype=torch.long).scatter_reduce(
                0, groups, keep.long(), "amax")  # (groups,) 1 where a sample of the prompt trains
            keep = alive[groups].bool()  # (b,)
        metrics.add({"zero_advantage_frac": 1.0 - float(keep.float().mean())})
        if bool(keep.all()) or self.dist.active:
            return minibatch, None
        rows = keep.nonzero().squeeze(1) if bool(keep.any()) else torch.zeros(1, dtype=torch.long)  # (b',)
        return minibatch.select(rows), rows


class PolicyWorker(_TrainedWorker):
    """Computes the policy's log-probs and runs its PPO-style updates (`PolicyRole`)."""

    def __init__(self, model: torch.nn.Module, backend: Any, settings: UpdateSettings, training_loss: PolicyTrainingLoss,
                 dist: DistContext = SINGLE, router_aux: RouterAux | None = None):
        super().__init__(model, backend, settings, dist)
        self.training_loss = training_loss
        self.router_aux = router_aux  # --aux-loss-coef: the MoE router loss of the training forwards
        self.keep_rows = 0  # `keep_logprobs`: the next update keeps its first rows' log-probs in `kept`
        self.kept: dict[int, torch.Tensor] = {}  # batch row -> (A,) its log-probs before the update

    def keep_logprobs(self, batch: ExperienceBatch, rows: int) -> bool:
        """Whether the next `fit` of ``batch`` can keep the log-probs of its first ``rows`` rows
        before the update from its own forwards (tokens.jsonl's, which then need no forward of
        their own): an on-policy batch trained in one optimizer step (one epoch, one minibatch, one
        process), those rows among the trained ones, and no dropout (the update's forwards run in
        training mode). When it can, that `fit` keeps them in ``kept``."""
        self.keep_rows, self.kept = 0, {}
        trajectories = batch.size if batch.trajectory_index is None else int(batch.trajectory_index.max()) + 1
        if batch.old_logprobs is not None or self.dist.active or self.settings.ppo_epochs != 1 or \
                self.settings.train_batch_size < trajectories or rows > trajectories or drops_out(self.model):
            return False
        if float(batch.loss_mask.sum()) == 0:
            return False  # an update with no loss token runs no forward
        trains = self.training_loss.trained_rows(batch.select(list(range(rows)))) if self.router_aux is None else None
        if trains is not None and not bool(trains.all()):
            return False  # a logged row the update skips: it has no forward to keep
        self.keep_rows = rows
        return True

    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        """(B, A) log-probs of the batch's tokens at the sampling temperature."""
        return self.logprobs_under(self.model, batch)

    def logprobs_under(self, model: torch.nn.Module, batch: ExperienceBatch) -> torch.Tensor:
        """(B, A) log-probs of the batch's tokens under ``model`` (the policy, or --async's copy of an
        earlier version of it), computed exactly as the policy's own."""
        return model_logprobs(model, batch, self.settings, temperature=self.training_loss.temperature, dist=self.dist)

    def fit(self, batch: ExperienceBatch, *, step: int, kl_coef: float | None = None) -> dict[str, float]:
        """PPO epochs over shuffled minibatches; one optimizer step per minibatch (`_fit`).
        ``batch.old_logprobs`` None means on-policy: old = current (detached), ratio 1.
        ``kl_coef``: this step's β of the KL term when adaptive (default: the objective's).
        With ``--aux-loss-coef`` every row trains (a row with nothing to add to the policy loss
        still routes tokens) and prompts are not shared (the shared forwards return no router
        logits over the real tokens)."""
        plain = self.router_aux is None
        try:
            metrics = self._fit(batch, step, lambda micro, norm: self._micro_loss(micro, norm, kl_coef), share=plain,
                                trained_rows=self.training_loss.trained_rows if plain else None)
        finally:
            self.keep_rows = 0  # `keep_logprobs` holds for one update
        return {k if "/" in k else f"policy/{k}": v for k, v in metrics.result(self.dist).items()}

    def _micro_loss(self, micro: MicroBatch, norm: LossNorm,
                    kl_coef: float | None = None) -> tuple[torch.Tensor, dict[str, Any], float]:
        def policy_loss() -> tuple[torch.Tensor, dict[str, Any]]:
            with self._known_gradient(micro, norm, kl_coef):
                logprobs, entropy = micro_logprobs(self._packed(self.train_model), micro,
                                                   temperature=self.training_loss.temperature,
                                                   with_entropy=self.training_loss.needs_entropy)  # (b, A), (b, A)|None
            if self.keep_rows and micro.before_update is not None:  # `keep_logprobs`
                for row, origin in enumerate(micro.before_update.tolist()):
                    if origin < self.keep_rows:
                        self.kept[origin] = logprobs[row].detach().cpu()
            return self.training_loss(logprobs, micro.batch, norm, entropy=entropy, kl_coef=kl_coef)

        tokens = float(micro.batch.loss_mask.sum())
        if self.router_aux is None:
            loss, metrics = policy_loss()
        else:  # the loss is this micro-batch's share of the step's: so is its router loss (its loss tokens')
            loss, metrics = self.router_aux.added(policy_loss, share=tokens / norm.num_tokens)
        return loss, metrics, tokens

    def _known_gradient(self, micro: MicroBatch, norm: LossNorm,
                        kl_coef: float | None) -> contextlib.AbstractContextManager[None]:
        """Around a micro-batch's training forward: the loss's gradient with respect to the log-probs,
        where it does not depend on their values (`PolicyTrainingLoss.logprob_gradient`), so the
        output layer may do its backward in the forward (`rlhf.core.logprobs.known_logprob_gradient`).
        In one process only, without a router loss."""
        if self.router_aux is not None or self.dist.active:
            return contextlib.nullcontext()
        return known_logprob_gradient(lambda: self.training_loss.logprob_gradient(micro.batch, norm, kl_coef=kl_coef))


def drops_out(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward in training mode drops anything out (a dropout module, or an
    attention dropout in its config)."""
    config = getattr(model, "config", None)
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


class CriticWorker(_TrainedWorker):
    """Computes values and fits them to the returns with the clipped value loss (`CriticRole`)."""

    def __init__(self, model: torch.nn.Module, backend: Any, settings: UpdateSettings, training_loss: ValueTrainingLoss,
                 dist: DistContext = SINGLE):
        super().__init__(model, backend, settings, dist)
        self.training_loss = training_loss

    @torch.no_grad()
    def values(self, batch: ExperienceBatch) -> torch.Tensor:
        """(B, A): the value of the state before each action token."""
        self.model.eval()
        model = forward_model(self.model, packing=False, ring=self.dist.ring)  # values run padded without a ring
        values = self._forward_rows(batch, lambda micro: model(micro.batch.input_ids.to(self.device),
                                                               micro.batch.attention_mask.to(self.device))[:, :-1])
        return values * batch.action_mask  # masked positions carry V = 0

    def fit(self, batch: ExperienceBatch, *, step: int) -> dict[str, float]:
        """Value-loss epochs over shuffled minibatches; one optimizer step per minibatch (`_fit`)."""
        metrics = self._fit(batch, step, self._micro_loss)
        return {k if "/" in k else f"critic/{k}": v for k, v in metrics.result(self.dist).items()}

    def _micro_loss(self, micro: MicroBatch, norm: LossNorm) -> tuple[torch.Tensor, dict[str, Any], float]:
        batch = micro.batch
        model = forward_model(self.train_model, packing=False, ring=self.dist.ring)
        values = model(batch.input_ids, batch.attention_mask)[:, :-1]  # (b, A)
        loss, metrics = self.training_loss(values, batch, norm)
        return loss, metrics, float(batch.loss_mask.sum())


class ReferenceWorker:
    """The frozen initial policy: log-probs for the KL term (`ReferenceRole`)."""

    def __init__(self, model: torch.nn.Module, micro_batch_size: int, temperature: float,
                 dist: DistContext = SINGLE, *, max_tokens_per_micro_batch: int | None = None, packing: bool = False,
                 share_prompt: bool = False, offload: bool = False):
        """``offload``: the model stays off the device except inside `logprobs` (``--offload-ref-reward``)."""
        self.model, self.micro_batch_size, self.temperature, self.dist = model, micro_batch_size, temperature, dist
        self.max_tokens, self.packing, self.share_prompt = max_tokens_per_micro_batch, packing, share_prompt
        self.device = next(model.parameters()).device
        self.away = ModuleOffload(model) if offload else None
        if self.away is not None:
            self.away.offload()

    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        with self.away.in_use() if self.away is not None else contextlib.nullcontext():
            return self._logprobs(batch)

    def _logprobs(self, batch: ExperienceBatch) -> torch.Tensor:
        model = forward_model(self.model, packing=self.packing, ring=self.dist.ring)
        return forward_rows(batch, self.dist, self.micro_batch_size, lambda micro: micro_logprobs(
            model, micro, temperature=self.temperature, device=self.device)[0], self.max_tokens, self.packing,
            self.share_prompt)


class RewardWorker:
    """Scores trajectories (`RewardRole`): the run's reward sources, plus each trajectory's
    environment reward (the sum of its step rewards), reported as the source ``env`` where an
    environment gives rewards (its ``gives_rewards`` capability, or an agent's reward) or gave one."""

    def __init__(self, reward_set: RewardSet | None):
        self.reward_set = reward_set  # None: the environment gives every reward

    def score(self, trajectories: list[Trajectory]) -> RewardResult:
        env_rewards = [float(t.info.get("env_reward", 0.0)) for t in trajectories]
        if self.reward_set is None:
            result = RewardResult(total=list(env_rewards), per_source={}, metrics={})
        else:
            result = self.reward_set.score_trajectories(trajectories)
            result.total = [t + e if t is not None else None for t, e in zip(result.total, env_rewards)]
        if any(t.info.get("env_gives_rewards") or e for t, e in zip(trajectories, env_rewards)):
            result.per_source["env"] = env_rewards  # an environment that gives none shows no phantom env reward 0
        return result
