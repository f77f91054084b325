"""What training optimises, checked as behaviour on the tiny model, against gradients computed
independently from the formulas (tests/runtime/recording.py keeps each optimizer step's gradient):

* the KL term of the loss has the gradient of β·mean(k3(logprobs, ref_logprobs)) against a distant reference;
* the entropy bonus has the gradient of −c·mean(H), H from the full softmax;
* a sample dropped by the reward failure policy adds nothing to the gradient, and is left out of
  the group statistics of the advantages;
* log-probs are computed at the sampling temperature (training, old and reference log-probs);
* old log-probs are recomputed when several optimizer steps share a rollout;
* critic value t is the critic's output at token t, in ``values`` and in training;
* micro-batch size 1 and 4 give the same gradients and weights after a real run;
* the reference model is not the policy: training the policy leaves the reference's log-probs as they were.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from rlhf.algorithms import resolve_algorithm, step_norm
from rlhf.core.batch import collate
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.core.types import Trajectory
from rlhf.runtime.config.train_config import TrainConfig
from rlhf.runtime.rl.local import train
from rlhf.runtime.config.train_plan import RunPlan
from rlhf.runtime.rl.workers import CriticWorker, PolicyWorker
from rlhf.runtime.step.micro_batches import UpdateSettings
from tests.helpers import MAX_NEW, ROWS, assert_same_gradients, make_batch
from tests.runtime.recording import RecordingBackend, recording_plugin



@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture
def model(base_model):
    return copy.deepcopy(base_model)


def full_logprobs(model, batch, temperature: float = 1.0):
    """(B, A) log-probs from the full vocabulary softmax, written out from the definition."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()[:, :-1] / temperature
    log_p = torch.log_softmax(logits, dim=-1)  # (B, A, V)
    return log_p.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1), log_p


def token_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def gradients(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def fit_once(model, batch, training_loss, *, micro_batch_size=3, worker_cls=PolicyWorker):
    RecordingBackend.clear()
    settings = UpdateSettings(train_batch_size=batch.size, micro_batch_size=micro_batch_size, max_new_tokens=MAX_NEW)
    worker = worker_cls(model, RecordingBackend(model), settings, training_loss)
    metrics = worker.fit(batch, step=0)
    assert len(RecordingBackend.steps) == 1
    return RecordingBackend.steps[0], metrics


KL_FORMULAS = {"k1": lambda d: d, "k2": lambda d: d.pow(2) / 2, "k3": lambda d: torch.exp(-d) - 1 + d}


@pytest.mark.unit
@pytest.mark.parametrize("estimator", sorted(KL_FORMULAS))
def test_kl_in_the_loss_has_the_estimators_gradient_against_a_distant_reference(model, plugins, estimator):
    batch = make_batch()
    with torch.no_grad():
        start, _ = full_logprobs(model, batch)
    offset = torch.rand(batch.action_mask.shape, generator=torch.Generator().manual_seed(2)) + 0.5  # (B, A) in [0.5, 1.5)
    batch.ref_logprobs = (start - offset) * batch.action_mask  # far from the policy, inside the ±10 clamp
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.5, kl_estimator=estimator, plugins=plugins)
    got, metrics = fit_once(model, batch, algo.policy_training_loss(None))  # SGD with lr 0: the weights stay

    logprobs, _ = full_logprobs(model, batch)
    kl = KL_FORMULAS[estimator](logprobs - batch.ref_logprobs)  # (B, A), δ = logprobs - ref_logprobs
    expected = gradients(model, 0.5 * token_mean(kl, batch.loss_mask))
    assert_same_gradients(got, expected)
    assert metrics["policy/kl"] == pytest.approx(float(token_mean(kl, batch.loss_mask)), rel=1e-4)


@pytest.mark.unit
def test_gspo_trains_per_sequence_whatever_the_runs_aggregation(model, plugins, make_plugin):
    """GSPO's registration declares its own aggregation (per sequence): under ``--loss-agg
    token_mean`` the policy step's gradient is that of the mean over sequences of each sequence's
    token mean of ℓ, and with zero advantages on some rows those rows are still skipped exactly."""
    batch = make_batch()
    advantages = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(4))  # (B, A)
    advantages[:2] = 0  # two rows (one prompt group) that add nothing
    batch.advantages = advantages * batch.action_mask
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0, policy_loss="gspo", loss_agg="token_mean",
                             plugins=plugins)
    training_loss = algo.policy_training_loss(None)
    assert training_loss.trained_rows(batch).tolist() == [False, False] + [True] * (ROWS - 2)
    got, _ = fit_once(model, batch, training_loss)

    logprobs, _ = full_logprobs(model, batch)  # on-policy: ratio 1, ℓ = −s·Â, s = exp(mean(log-ratio))
    mask = batch.loss_mask  # (B, A)
    mean_log_ratio = ((logprobs - logprobs.detach()) * mask).sum(dim=1) / mask.sum(dim=1)  # (B,)
    per_token = -torch.exp(mean_log_ratio)[:, None] * batch.advantages  # (B, A)
    per_sequence = (per_token * mask).sum(dim=1) / mask.sum(dim=1)  # (B,)
    assert_same_gradients(got, gradients(model, per_sequence.mean()))
    # the rows GSPO skips depend on its own aggregation, not on the run's (here one that is no sum of rows)
    plugins.register(make_plugin("squared_mean", register_loss_aggregations=lambda register: register(
        "squared_mean", lambda loss, loss_mask, norm: ((loss * loss_mask).sum() / norm.num_tokens) ** 2)))
    squared = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0, policy_loss="gspo", loss_agg="squared_mean",
                                plugins=plugins)
    assert squared.policy_training_loss(None).trained_rows(batch) is not None
    assert resolve_algorithm("grpo", n_samples=2, kl_coef=0.0, loss_agg="squared_mean",
                             plugins=plugins).policy_training_loss(None).trained_rows(batch) is None  # ppo: the run's


@pytest.mark.unit
def test_the_entropy_bonus_has_the_gradient_of_minus_c_times_the_mean_entropy(model, plugins):
    batch = make_batch()
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0, plugins=plugins)
    got, metrics = fit_once(model, batch, algo.policy_training_loss(None, entropy_coef=0.1, temperature=0.7))
    _, log_p = full_logprobs(model, batch, temperature=0.7)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)  # (B, A)
    expected = gradients(model, -0.1 * token_mean(entropy, batch.loss_mask))
    assert_same_gradients(got, expected)
    assert metrics["policy/entropy"] == pytest.approx(float(token_mean(entropy, batch.loss_mask)), rel=1e-4)


AGGREGATIONS = {
    "token_mean": lambda x, m: (x * m).sum() / m.sum(),
    "seq_mean_token_mean": lambda x, m: ((x * m).sum(-1) / m.sum(-1)).sum() / (m.sum(-1) > 0).sum(),
    "seq_mean_token_sum_norm": lambda x, m: ((x * m).sum(-1) / MAX_NEW).sum() / (m.sum(-1) > 0).sum(),
}


@pytest.mark.unit
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_the_policy_gradient_is_minus_the_aggregated_advantage_weighted_score(model, plugins, aggregation):
    """On-policy (ratio 1): the PPO loss's gradient is −agg(Â ∇logprobs), with the run's aggregation."""
    batch = make_batch()
    batch.advantages = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(3)) * \
        batch.action_mask  # (B, A)
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0, loss_agg=aggregation, plugins=plugins)
    got, _ = fit_once(model, batch, algo.policy_training_loss(None))
    logprobs, _ = full_logprobs(model, batch)
    expected = -AGGREGATIONS[aggregation](batch.advantages * logprobs, batch.loss_mask)
    assert_same_gradients(got, gradients(model, expected))


@pytest.mark.unit
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01], ids=["skipped-row", "trained-row"])
def test_a_dropped_sample_adds_nothing_to_the_gradient(base_model, plugins, entropy_coef):
    """Without an entropy term the dropped row is not even run (zero advantages on its loss tokens);
    with one every row runs, and the loss mask must leave it out."""
    batch = make_batch()
    batch.advantages = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(4)) * \
        batch.action_mask  # (B, A)
    batch.advantages[5] = 50.0 * batch.action_mask[5]  # a skipped sample with a large advantage
    batch.sample_mask[5] = 0.0
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0, plugins=plugins)
    training_loss = algo.policy_training_loss(None, entropy_coef=entropy_coef)
    with_dropped, _ = fit_once(copy.deepcopy(base_model), batch, training_loss)
    kept = batch.select([r for r in range(ROWS) if r != 5])
    without, _ = fit_once(copy.deepcopy(base_model), kept, training_loss)
    assert_same_gradients(with_dropped, without)


@pytest.mark.unit
def test_the_steps_metrics_are_means_over_its_loss_tokens_however_it_is_split(base_model, plugins):
    """Micro-batch metrics are weighted by their loss tokens: with dropped samples (action tokens
    that are not loss tokens) the step's KL and entropy equal one micro-batch's over every row."""
    batch = make_batch()
    generator = torch.Generator().manual_seed(6)
    batch.advantages = torch.randn(batch.action_mask.shape, generator=generator) * batch.action_mask  # (B, A)
    batch.ref_logprobs = -5.0 + torch.randn(batch.action_mask.shape, generator=generator)  # (B, A)
    batch.sample_mask[1] = batch.sample_mask[2] = 0.0  # both in the first micro-batch of 3
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.05, plugins=plugins)
    training_loss = algo.policy_training_loss(None, entropy_coef=0.01)
    _, whole = fit_once(copy.deepcopy(base_model), batch, training_loss, micro_batch_size=ROWS)
    _, split = fit_once(copy.deepcopy(base_model), batch, training_loss, micro_batch_size=3)
    for key in ("policy/kl", "policy/entropy"):
        assert math.isclose(split[key], whole[key], rel_tol=1e-5), key
    _, log_p = full_logprobs(base_model, batch)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)  # (B, A)
    assert math.isclose(whole["policy/entropy"], float(token_mean(entropy, batch.loss_mask)), rel_tol=1e-4)


@pytest.mark.unit
def test_a_nonfinite_step_is_skipped_and_the_count_resets_after_a_good_one(base_model, plugins):
    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0, plugins=plugins)
    settings = UpdateSettings(train_batch_size=ROWS, micro_batch_size=4, max_new_tokens=MAX_NEW)
    model = copy.deepcopy(base_model)
    worker = PolicyWorker(model, RecordingBackend(model, lr=1e-2), settings, algo.policy_training_loss(None))
    good, bad = make_batch(), make_batch()
    good.advantages = torch.ones_like(good.action_mask) * good.action_mask
    bad.advantages = good.advantages.clone()
    bad.advantages[3] = float("nan")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert worker.fit(bad, step=0)["policy/skipped_steps"] == 1.0 and worker.nonfinite_in_a_row == 1
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the step was dropped
    worker.fit(bad, step=1)
    assert worker.nonfinite_in_a_row == 2
    assert worker.fit(good, step=2)["policy/skipped_steps"] == 0.0 and worker.nonfinite_in_a_row == 0


@pytest.mark.run
def test_a_saved_worker_loads_back_exactly(base_model, tmp_path, plugins):
    from rlhf.plugins.backends.config import BackendConfig
    from rlhf.plugins.backends.torch_backend import TorchBackend

    algo = resolve_algorithm("grpo", n_samples=2, kl_coef=0.0, plugins=plugins)
    settings = UpdateSettings(train_batch_size=4, micro_batch_size=4, max_new_tokens=MAX_NEW)

    def worker():
        model = copy.deepcopy(base_model)
        return PolicyWorker(model, TorchBackend(model, BackendConfig(lr=1e-2, total_steps=10, lr_scheduler="cosine")),
                            settings, algo.policy_training_loss(None))

    batch = make_batch()
    batch.advantages = torch.ones_like(batch.action_mask) * batch.action_mask
    first = worker()
    first.fit(batch, step=0)
    first.nonfinite_in_a_row = 2
    first.save(tmp_path / "policy")
    second = worker()
    second.load(tmp_path / "policy")
    assert second.nonfinite_in_a_row == 2
    first.fit(batch, step=1)
    second.fit(batch, step=1)  # same weights, optimizer moments and LR schedule: the same update
    for (name, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.unit
def test_minibatches_are_a_seeded_permutation_per_step_and_epoch():
    from rlhf.runtime.step.micro_batches import minibatches

    batch = make_batch()
    batch.input_ids[:, 0] = torch.arange(ROWS)  # row ids, to read the order back

    def order(seed, step):
        settings = UpdateSettings(ppo_epochs=2, train_batch_size=4, micro_batch_size=2, max_new_tokens=MAX_NEW,
                                  seed=seed)
        return [mb.input_ids[:, 0].tolist() for mb in minibatches(batch, settings, step)]

    first = order(seed=3, step=0)
    assert len(first) == 4 and all(len(rows) == 4 for rows in first)
    assert sorted(first[0] + first[1]) == sorted(first[2] + first[3]) == list(range(ROWS))  # each epoch, every row
    assert order(seed=3, step=0) == first  # resumable: the same (seed, step) gives the same order
    assert order(seed=4, step=0) != first and order(seed=3, step=1) != first and first[:2] != first[2:]


@pytest.mark.unit
def test_the_runs_seed_shuffles_the_minibatches(tiny_model_dir, task, tmp_path):
    from rlhf.runtime.rl.local import update_settings

    plan = RunPlan.make(config(tiny_model_dir, task, tmp_path / "run", seed=123, ppo_epochs=3, train_batch_size=4),
                        build_plugin_manager(load_entrypoints=False))
    assert update_settings(plan) == UpdateSettings(ppo_epochs=3, train_batch_size=4, micro_batch_size=4,
                                                   max_new_tokens=6, share_prompt=True, seed=123)


@pytest.mark.unit
def test_the_reward_is_the_sources_plus_the_environments():
    from rlhf.rewards.combine import RewardResult
    from rlhf.runtime.rl.workers import RewardWorker

    class Sources:
        def score_trajectories(self, trajectories):
            return RewardResult(total=[1.0, None, 0.25], per_source={"judge": [1.0, None, 0.25]}, metrics={"m": 1.0})

    trajectories = [Trajectory(token_ids=[1, 2], loss_mask=[0, 1], prompt_length=1, prompt="", prompt_text="",
                               completion_text="", group=0, info={"env": "calc", "env_reward": reward})
                    for reward in (0.5, 2.0, -1.0)]
    result = RewardWorker(Sources()).score(trajectories)
    assert result.total == [1.5, None, -0.75]  # a failed source score stays a dropped sample
    assert result.per_source == {"judge": [1.0, None, 0.25], "env": [0.5, 2.0, -1.0]}
    alone = RewardWorker(None).score(trajectories)
    assert alone.total == [0.5, 2.0, -1.0] and alone.metrics == {}
    del trajectories[2].info["env_reward"]  # a trajectory no environment rewarded: 0 from the env
    assert RewardWorker(Sources()).score(trajectories).total == [1.5, None, 0.25]


@pytest.mark.unit
def test_a_dropped_sample_adds_nothing_to_the_critics_gradient(plugins):
    batch = make_batch()
    batch.values = torch.zeros_like(batch.action_mask)
    batch.returns = torch.rand(batch.action_mask.shape, generator=torch.Generator().manual_seed(9)) * 300
    batch.returns[2] = 1e4 * batch.action_mask[2]  # a dropped sample with an outlandish return
    batch.sample_mask[2] = 0.0
    training_loss = resolve_algorithm("ppo", n_samples=1, plugins=plugins).value_training_loss(clip=None)
    with_dropped, _ = fit_once(PositionCritic(), batch, training_loss, worker_cls=CriticWorker)
    without, _ = fit_once(PositionCritic(), batch.select([r for r in range(ROWS) if r != 2]), training_loss,
                          worker_cls=CriticWorker)
    assert float(with_dropped["w"]) == pytest.approx(float(without["w"]), rel=1e-5)


class PositionCritic(torch.nn.Module):
    """V(s_t) = w · token_t: the value read at a position names the token it was read at."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, input_ids, attention_mask):
        return self.w * input_ids.float()  # (B, T)


@pytest.mark.unit
def test_kl_goes_into_the_reward_when_it_is_placed_there(plugins):
    """PPO's per-token reward: R_t = -β·kl_t, plus r on the last action token; returns sum them up."""
    from rlhf.runtime.rl.experience import ExperienceMaker

    class Fixed:
        def __init__(self, logprobs):
            self.logprobs = lambda batch: logprobs

    trajectory = Trajectory(token_ids=[5, 6, 7], loss_mask=[0, 1, 1], prompt_length=1, prompt="", prompt_text="",
                            completion_text="", group=0)
    batch = collate([trajectory], pad_token_id=0, rewards=torch.tensor([1.0]), sample_mask=torch.ones(1))
    old, ref = torch.tensor([[0.0, 0.0]]), torch.tensor([[-0.5, -1.0]])  # k1 = [0.5, 1.0]
    for kl_in, expected in (("reward", [1.0 - 0.1 * 1.5, 1.0 - 0.1 * 1.0]), ("loss", [1.0, 1.0])):
        algo = resolve_algorithm("reinforce_pp", n_samples=1, kl_in=kl_in, kl_coef=0.1, kl_estimator="k1",
                                 plugins=plugins)
        maker = ExperienceMaker(algo, None, n_samples=1, recompute_old=True)
        made = maker.make(batch, Fixed(old), Fixed(ref))
        assert made.kl.tolist() == [[0.5, 1.0]] and made.ref_logprobs is ref and made.old_logprobs is old
        assert made.returns.tolist() == [pytest.approx(expected)], kl_in


@pytest.mark.unit
def test_critic_value_t_is_the_output_at_token_t_in_values_and_in_training(plugins):
    batch = make_batch()
    critic = PositionCritic()
    training_loss = resolve_algorithm("ppo", n_samples=1, plugins=plugins).value_training_loss(clip=0.5)
    worker = CriticWorker(critic, RecordingBackend(critic), UpdateSettings(train_batch_size=ROWS, micro_batch_size=3,
                                                                         max_new_tokens=MAX_NEW), training_loss)
    values = worker.values(batch)  # (B, A)
    assert torch.equal(values, 0.5 * batch.input_ids[:, :-1].float() * batch.action_mask)
    batch.values = values
    batch.returns = torch.rand(batch.action_mask.shape, generator=torch.Generator().manual_seed(5)) * 300
    got, _ = fit_once(critic, batch, training_loss, worker_cls=CriticWorker)
    # at the old values V_clip = V, so the loss is 0.5·mean((V − G)²) and dL/dw = mean((V − G)·token_t)
    ids = batch.input_ids[:, :-1].float()
    expected = token_mean((0.5 * ids - batch.returns) * ids, batch.loss_mask)
    assert float(got["w"]) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_the_critic_loss_uses_the_runs_aggregation_with_the_steps_counts(plugins, aggregation):
    batch = make_batch()
    ids = batch.input_ids[:, :-1].float()
    batch.values = 0.5 * ids * batch.action_mask
    batch.returns = torch.rand(batch.action_mask.shape, generator=torch.Generator().manual_seed(8)) * 300
    training_loss = resolve_algorithm("ppo", n_samples=1, loss_agg=aggregation,
                                  plugins=plugins).value_training_loss(clip=0.5)
    micro = batch.select([0, 1, 2])  # one micro-batch of a step of 8 rows
    norm = step_norm(batch, MAX_NEW)
    loss, _ = training_loss(0.5 * micro.input_ids[:, :-1].float(), micro, norm)
    error = (0.5 * micro.input_ids[:, :-1].float() - micro.returns) ** 2 * micro.loss_mask  # (b, A)
    per_row = error.sum(-1) / (micro.loss_mask.sum(-1) if aggregation == "seq_mean_token_mean" else MAX_NEW)
    expected = 0.5 * per_row.sum() / (batch.loss_mask.sum(-1) > 0).sum()  # the step's sequences, not the micro's
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.unit
def test_the_critic_is_clipped_around_its_old_values_with_the_runs_clip(plugins):
    batch = make_batch()
    critic = PositionCritic()
    training_loss = resolve_algorithm("ppo", n_samples=1, plugins=plugins).value_training_loss(clip=0.2)
    ids = batch.input_ids[:, :-1].float()  # (B, A)
    offsets = torch.rand(ids.shape, generator=torch.Generator().manual_seed(7)) - 0.5  # (B, A) in [-0.5, 0.5)
    batch.values = (0.5 * ids + offsets) * batch.action_mask  # old values off by up to ±0.5: some clipped
    # returns past the old values, so where |V - V_old| > clip the clipped error is the larger (no gradient)
    batch.returns = batch.values - 3 * offsets
    got, _ = fit_once(critic, batch, training_loss, worker_cls=CriticWorker)
    w = torch.tensor(0.5, requires_grad=True)
    values = w * ids
    clipped = batch.values + (values - batch.values).clamp(-0.2, 0.2)
    loss = 0.5 * token_mean(torch.max((clipped - batch.returns) ** 2, (values - batch.returns) ** 2), batch.loss_mask)
    loss.backward()
    assert float(got["w"]) == pytest.approx(float(w.grad), rel=1e-5)
    unclipped = 0.5 * token_mean((w * ids - batch.returns) ** 2, batch.loss_mask)
    assert float(torch.autograd.grad(unclipped, w)[0]) != pytest.approx(float(w.grad), rel=1e-2)  # the clip matters


# --- through a real run -----------------------------------------------------------------------


def config(model_dir, task, out, **overrides):
    values = dict(model=str(model_dir), data=[str(task / "data.jsonl")], label_key="answer",
                  reward=[str(task / "rewards.py")], prompts_per_step=2, n_samples=4, max_new_tokens=6,
                  micro_batch_size=4, steps=1, lr=1e-2, out=str(out), progress=False, seed=11)
    values.update(overrides)
    return TrainConfig.from_dict(values)


def metrics_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.run
def test_micro_batch_size_1_and_4_give_the_same_gradients_and_weights(tiny_model_dir, task, tmp_path, plugins):
    plugins.register(recording_plugin())
    runs = {}
    for size in (1, 4):
        RecordingBackend.clear()
        out = train(config(tiny_model_dir, task, tmp_path / f"mb{size}", backend="recording", micro_batch_size=size,
                           ppo_epochs=2, train_batch_size=4, kl_coef=0.05, entropy_coef=0.01), plugins=plugins)
        from transformers import AutoModelForCausalLM

        runs[size] = (list(RecordingBackend.steps), AutoModelForCausalLM.from_pretrained(out / "final").state_dict())
    (steps_one, weights_one), (steps_four, weights_four) = runs[1], runs[4]
    assert len(steps_one) == len(steps_four) == 4  # 2 epochs x 2 minibatches
    for one, four in zip(steps_one, steps_four):
        assert_same_gradients(four, one, atol=1e-5)
    for name, weight in weights_one.items():
        assert torch.allclose(weight, weights_four[name], atol=1e-6), name


@pytest.mark.run
@pytest.mark.parametrize("ppo_epochs, train_batch_size", [(2, 8), (1, 4), (2, 4)])  # 2, 2 and 4 optimizer steps
def test_old_logprobs_are_recomputed_when_optimizer_steps_share_a_rollout(tiny_model_dir, task, tmp_path, plugins,
                                                                          ppo_epochs, train_batch_size):
    out = train(config(tiny_model_dir, task, tmp_path / "run", ppo_epochs=ppo_epochs,
                       train_batch_size=train_batch_size, lr=5e-3), plugins=plugins)
    step = metrics_of(out)[0]
    # Without old log-probs of their own, every step would be on-policy: ratio 1, approx_kl exactly 0.
    assert abs(step["policy/approx_kl"]) > 1e-5 and step["policy/clip_frac"] > 0


@pytest.mark.run
@pytest.mark.parametrize("algo, overrides", [
    ("grpo", {"algo_config": ["correction=tis"], "kl_coef": 0.01}),  # KL in the loss; engine log-probs compared
    ("ppo", {"n_samples": 1, "prompts_per_step": 4}),  # KL in the reward: old and reference log-probs
])
def test_logprobs_are_taken_at_the_sampling_temperature(tiny_model_dir, task, tmp_path, plugins, algo, overrides):
    out = train(config(tiny_model_dir, task, tmp_path / "run", algo=algo, temperature=0.7, **overrides),
                plugins=plugins)
    step = metrics_of(out)[0]
    assert abs(step["kl/mean"]) < 1e-5  # the policy starts as the reference, at any temperature
    if algo == "grpo":
        assert abs(step["policy/mismatch_kl"]) < 1e-3 and step["policy/correction_weight_mean"] == \
            pytest.approx(1.0, abs=1e-3)


@pytest.mark.run
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_training_the_policy_leaves_the_reference_as_it_was(tiny_model_dir, task, tmp_path, plugins, lora_rank):
    from rlhf.runtime.rl.local import build_workers
    from rlhf.runtime.config.train_plan import RunPlan

    run = config(tiny_model_dir, task, tmp_path / "run", lora_rank=lora_rank, kl_coef=0.01)
    workers, _ = build_workers(RunPlan.make(run, plugins), plugins)
    policy, reference = workers.policy, workers.reference
    if lora_rank == 0:
        shared = {p.data_ptr() for p in policy.model.parameters()} & {p.data_ptr() for p in reference.model.parameters()}
        assert not shared, "the reference shares weights with the policy"
    batch = make_batch()
    batch.advantages = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(6)) * \
        batch.action_mask
    batch.ref_logprobs = reference.logprobs(batch)
    before_policy = policy.logprobs(batch)
    assert torch.allclose(before_policy, batch.ref_logprobs, atol=1e-6)  # both start from the same weights
    policy.fit(batch, step=0)
    assert not torch.allclose(policy.logprobs(batch), before_policy, atol=1e-4), "the policy did not train"
    assert torch.equal(reference.logprobs(batch), batch.ref_logprobs), "training the policy moved the reference"


SEEN_MASKS: list[list[bool]] = []
SEEN_REWARDS: list[list[float]] = []


def grpo_recording_masks(inputs, config):
    """grpo, recording which samples it was told to leave out."""
    from rlhf.algorithms import compute_advantages

    SEEN_MASKS.append(inputs.sample_mask.tolist())
    SEEN_REWARDS.append(inputs.rewards.tolist())
    return compute_advantages("grpo", rewards=inputs.rewards, action_mask=inputs.action_mask,
                              group_size=inputs.group_size, sample_mask=inputs.sample_mask)


@pytest.mark.run
def test_a_sample_without_a_reward_is_left_out_of_the_group_statistics(tiny_model_dir, task, tmp_path, plugins,
                                                                       make_plugin):
    (tmp_path / "rewards.py").write_text("def reward_func(completions, **kwargs):\n"
                                         "    return [None if i == 1 else float(i) for i in range(len(completions))]\n")
    plugins.register(make_plugin("masks", register_advantage_estimators=lambda register: register(
        "grpo_masks", grpo_recording_masks, needs_groups=True)))
    SEEN_MASKS.clear()
    SEEN_REWARDS.clear()
    out = train(config(tiny_model_dir, task, tmp_path / "run", advantage="grpo_masks",
                       reward=[str(tmp_path / "rewards.py")]), plugins=plugins)
    assert SEEN_MASKS == [[True, False, True, True, True, True, True, True]]
    assert SEEN_REWARDS == [[0.0, 0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]  # the dropped sample's reward is a plain 0
    assert metrics_of(out)[0]["reward/skipped"] == 1.0


@pytest.mark.unit
def test_token_budgets_are_refused_where_every_forward_is_a_collective():
    from types import SimpleNamespace

    from rlhf.core.errors import RlhfError
    from rlhf.runtime.step.trained import TrainedModel

    model = torch.nn.Linear(2, 2)
    sharded = SimpleNamespace(train_module=model, shards_weights=True)
    two_ranks = SimpleNamespace(active=True, world_size=2)
    with pytest.raises(RlhfError, match="--max-tokens-per-micro-batch does not work with a backend that shards"):
        TrainedModel(model, sharded, two_ranks).check_token_budget(64)
    TrainedModel(model, sharded, two_ranks).check_token_budget(None)
    TrainedModel(model, SimpleNamespace(train_module=model, shards_weights=False), two_ranks).check_token_budget(64)
    TrainedModel(model, sharded, SimpleNamespace(active=False, world_size=1)).check_token_budget(64)
