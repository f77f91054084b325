"""RL options in combination, through ``rlhf train`` (the CLI, in-process) on the tiny model,
checked against log-probs, KL and gradients computed independently from the weights that
`tests/runtime/recording.py` keeps:

* --async with staleness K ≥ 1 and several optimizer steps per rollout (--ppo-epochs 2), or KL in
  the reward: the PPO ratio and the KL use the behaviour policy's log-probs (the weights that
  sampled the batch, K versions old), not log-probs recomputed with the trained weights;
* the adaptive KL controller with KL in the reward: each step's per-token penalty uses the β the
  controller computed after the step before;
* --async with generation slower than training: a checkpoint taken while batches are still being
  generated resumes exactly.

Shape legend: ``B`` sequences, ``T`` tokens, ``A = T - 1`` action positions.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import rlhf
from rlhf.algorithms.components import load_component
from rlhf.core.plugin_host.loading import PluginSet
from tests.helpers import assert_same_gradients, final_weights, read_jsonl, run_cli
from tests.runtime.recording import RecordingBackend, recording_plugin

pytestmark = pytest.mark.run

# Every sample a different reward: the advantages are never all zero.
DENSE_REWARD = "def dense(completions, **kwargs):\n    return [sum(map(ord, c)) % 97 / 97 for c in completions]\n"
PROMPTS_PER_STEP, N_SAMPLES = 2, 2
ROLLOUT_ROWS = PROMPTS_PER_STEP * N_SAMPLES
CLIP = 0.2  # the ppo loss's default ε (both sides)


def train_cli(plugins: PluginSet, model_dir: Path, task: Path, reward: Path, out: Path, *options: str) -> int:
    """``rlhf train`` on the toy task with one thread and a fixed seed; its exit code."""
    result = run_cli(plugins, ["train", "--model", str(model_dir), "--data", str(task / "data.jsonl"),
                               "--label-key", "answer", "--reward", f"{reward}:dense",
                               "--prompts-per-step", str(PROMPTS_PER_STEP), "--n-samples", str(N_SAMPLES),
                               "--max-new-tokens", "6", "--micro-batch-size", "2", "--seed", "5", "--threads", "1",
                               "--no-progress", "--out", str(out), *options])
    assert result.exit_code in (0, 130), result.output
    return result.exit_code


@pytest.fixture
def reward(tmp_path: Path) -> Path:
    path = tmp_path / "dense.py"
    path.write_text(DENSE_REWARD)
    return path


class Recorder:
    """A plugin recording what a run's steps were made of: each rollout batch's trajectories (by
    step, from ``on_rewards``) and what the advantage estimator ``recorded`` (``reinforce_pp``
    itself) received and returned, one entry per step in step order."""

    def __init__(self) -> None:
        self.trajectories: dict[int, list[Any]] = {}
        self.estimates: list[dict[str, Any]] = []

    def module(self) -> Any:
        import types

        module = types.ModuleType("rl_combinations_recorder")
        estimator = load_component("advantage_estimator", "reinforce_pp")

        def recorded(inputs, config):
            advantages, returns = estimator(inputs, config)
            self.estimates.append({"kl": None if inputs.kl is None else inputs.kl.clone(), "kl_coef": inputs.kl_coef,
                                   "action_mask": inputs.action_mask.clone(), "advantages": advantages.clone()})
            return advantages, returns

        module.register_advantage_estimators = rlhf.hookimpl(lambda register: register("recorded", recorded))
        module.on_rewards = rlhf.hookimpl(lambda step, trajectories: self.trajectories.__setitem__(
            step, copy.deepcopy(trajectories)))
        return module


class ProducerLag:
    """A plugin that makes --async generation lag training as far as --max-staleness K allows: the
    batch of step s (steps numbered from 0, as ``on_step_end`` numbers them) is held in
    ``on_rewards``, on the producer's thread, until the trainer has finished step s − K, then for
    ``delay_s`` more. The trainer's weights have then moved on from version s − K, which sampled
    the batch, and a checkpoint written right after step s − K finds the batch still being made."""

    def __init__(self, staleness: int, delay_s: float = 0.0):
        self.staleness, self.delay_s = staleness, delay_s
        self.finished = -1  # the last step the trainer finished
        self.changed = threading.Condition()
        self.finished_at: dict[int, float] = {}
        self.checkpoint_waits: dict[int, float] = {}  # checkpoint after N steps: seconds from step N - 1's end

    def module(self) -> Any:
        import types

        module = types.ModuleType("rl_combinations_producer_lag")

        def on_run_start(run):
            self._finish(run.start_step - 1)  # a resumed run's earlier steps are done

        def on_step_end(step):
            self.finished_at[step] = time.perf_counter()
            self._finish(step)

        def on_checkpoint(step):
            self.checkpoint_waits[step] = time.perf_counter() - self.finished_at[step - 1]

        def on_rewards(step):
            with self.changed:
                released = self.changed.wait_for(lambda: self.finished >= step - self.staleness, timeout=60)
            assert released, "the trainer stalled"
            time.sleep(self.delay_s)

        for hook in (on_run_start, on_step_end, on_checkpoint, on_rewards):
            setattr(module, hook.__name__, rlhf.hookimpl(hook))
        return module

    def _finish(self, step: int) -> None:
        with self.changed:
            self.finished = step
            self.changed.notify_all()


def padded(trajectories: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T) token ids and attention mask, right-padded, and the (B, A) action mask."""
    length = max(len(t.token_ids) for t in trajectories)
    input_ids = torch.zeros(len(trajectories), length, dtype=torch.long)  # (B, T)
    attention = torch.zeros(len(trajectories), length, dtype=torch.long)  # (B, T)
    generated = torch.zeros(len(trajectories), length)  # (B, T) 1 on the policy's tokens
    for row, trajectory in enumerate(trajectories):
        n = len(trajectory.token_ids)
        input_ids[row, :n] = torch.tensor(trajectory.token_ids)
        attention[row, :n] = 1
        generated[row, :n] = torch.tensor(trajectory.loss_mask, dtype=torch.float32)
    return input_ids, attention, generated[:, 1:]  # position t predicts token t + 1


class Policy:
    """The tiny model with weights set by name (a `RecordingBackend.weights` entry), computing
    log-probs from the full softmax."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).float()
        self.parameters = dict(self.model.named_parameters())

    def set(self, weights: dict[str, torch.Tensor]) -> Policy:
        with torch.no_grad():
            for name, value in weights.items():
                self.parameters[name].copy_(value)
        return self

    def logprobs(self, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """(B, A) log-probability of token t + 1 at position t (temperature 1)."""
        logits = self.model(input_ids=input_ids, attention_mask=attention).logits.float()[:, :-1]  # (B, A, V)
        return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, A)

    def gradient(self, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        self.model.zero_grad()
        loss.backward()
        return {name: p.grad.detach().clone() for name, p in self.parameters.items()}


def ppo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
    """Token mean of PPO's clipped surrogate, −min(r·Â, clip(r, 1 ± ε)·Â),
    r = exp(logprobs − old_logprobs)."""
    ratio = torch.exp(logprobs - old_logprobs)  # (B, A)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)  # (B, A)
    return -(surrogate * mask).sum() / mask.sum()


# --- a. --async: the behaviour policy's log-probs -----------------------------------------------


@pytest.mark.parametrize("options, steps_per_rollout", [
    (["--ppo-epochs", "2", "--kl-in", "none"], 2),  # old log-probs for a second optimizer step
    (["--kl-in", "reward"], 1),  # old log-probs for the KL in the reward
], ids=["ppo-epochs-2", "kl-in-reward"])
def test_async_trains_against_the_behaviour_policys_logprobs(tiny_model_dir, task, reward, tmp_path, plugins,
                                                             options, steps_per_rollout):
    """With --max-staleness 1, the batch of step s ≥ 1 was sampled by version s − 1 of the policy
    and trains version s. The ratio of the PPO loss must be exp(logprobs_s − logprobs_{s−1}), and KL in
    the reward k1 = logprobs_{s−1} − ref_logprobs: the behaviour log-probs the producer computed with the
    weights that sampled. A trainer that recomputed the old log-probs with the weights it trains
    (what a synchronous run does when an optimizer step or the KL needs them) would see a ratio
    of exactly 1 at each step's first optimizer step and the trained policy's KL: the importance
    correction for the staleness would be lost, and this test's gradient and KL would differ.
    Generation is held back until the trainer has moved on (`ProducerLag`), so a producer that
    took the log-probs from the trainer's live policy instead of its own copy fails too."""
    recorder = Recorder()
    plugins.register(recording_plugin())
    plugins.register(recorder.module())
    plugins.register(ProducerLag(staleness=1).module())  # the trainer holds version s when batch s is made
    RecordingBackend.clear()
    train_cli(plugins, tiny_model_dir, task, reward, tmp_path / "run", "--algo", "reinforce_pp", "--advantage",
              "recorded", "--backend", "recording", "--lr", "0.5", "--train-batch-size", str(ROLLOUT_ROWS),
              "--steps", "3", "--async", "--max-staleness", "1", *options)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["async/version"] for m in metrics] == [0, 0, 1]
    assert len(RecordingBackend.steps) == 3 * steps_per_rollout and len(recorder.estimates) == 3

    def version(v: int) -> dict[str, torch.Tensor]:  # the weights after v steps
        return RecordingBackend.weights[v * steps_per_rollout]

    policy = Policy(tiny_model_dir)
    for step in (1, 2):
        input_ids, attention, action_mask = padded(recorder.trajectories[step])  # (B, T), (B, T), (B, A)
        estimate = recorder.estimates[step]
        assert torch.equal(estimate["action_mask"], action_mask)
        with torch.no_grad():
            behaviour = policy.set(version(step - 1)).logprobs(input_ids, attention)  # (B, A)
            reference = policy.set(version(0)).logprobs(input_ids, attention)  # (B, A)
        trained = policy.set(version(step)).logprobs(input_ids, attention)  # (B, A), with grad
        # the staleness shows: otherwise any choice of old log-probs would pass
        assert float(((trained.detach() - behaviour).abs() * action_mask).max()) > 1e-2
        if "reward" in options:
            assert estimate["kl_coef"] == 0.01  # reinforce_pp's β
            expected_kl = (behaviour - reference).clamp(-10, 10) * action_mask  # k1, (B, A)
            assert torch.allclose(estimate["kl"], expected_kl, atol=2e-5), step
        else:
            assert estimate["kl"] is None
        # the step's first optimizer step: the whole rollout batch, the PPO loss with old_logprobs = behaviour
        loss = ppo_loss(trained, behaviour, estimate["advantages"], action_mask)
        expected = policy.gradient(loss)
        assert_same_gradients(RecordingBackend.steps[step * steps_per_rollout], expected, atol=1e-5)


# --- b. adaptive β with KL in the reward ------------------------------------------------------------


def sequence_mean_kl(kl: torch.Tensor, action_mask: torch.Tensor) -> float:
    """The mean over samples of each sample's token-mean KL: what the controller is told."""
    per_sample = (kl * action_mask).sum(dim=1) / action_mask.sum(dim=1)  # (B,)
    return float(per_sample.mean())


def test_adaptive_beta_reaches_the_next_steps_rewards(tiny_model_dir, task, reward, tmp_path, plugins):
    """β_{k+1} = β_k·(1 + clip(KL_k / target − 1, ±0.2)·B / horizon) after step k, and step k + 1's
    per-token reward −β·kl must use that β: the estimator receives it, and ``kl/beta`` reports it.
    A controller whose update is dropped, applied one step late or early, or not passed to the
    experience (the preset's fixed β in the reward while the metric moves) fails here. The target
    is set so that step 1's error, KL_1 / target − 1 = 0.1, is not clipped: the KL the controller
    is told counts too."""
    beta, horizon = 0.05, 20
    common = ["--algo", "reinforce_pp", "--advantage", "recorded", "--kl-in", "reward", "--kl-coef", str(beta),
              "--kl-estimator", "k2", "--kl-horizon", str(horizon), "--lr", "1e-2"]  # k2 ≥ 0: a KL ratio > 0
    # KL_1 does not depend on the target (step 0 samples from the reference: KL 0, error clipped at -0.2)
    recorder = Recorder()
    plugins.register(recorder.module())
    train_cli(plugins, tiny_model_dir, task, reward, tmp_path / "probe", *common, "--kl-target", "1e-6", "--steps", "2")
    kl_1 = sequence_mean_kl(recorder.estimates[1]["kl"], recorder.estimates[1]["action_mask"])
    assert kl_1 > 1e-4
    recorder.estimates.clear()
    target = kl_1 / 1.1
    train_cli(plugins, tiny_model_dir, task, reward, tmp_path / "run", *common, "--kl-target", repr(target),
              "--steps", "3")
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    expected = [beta]
    for estimate in recorder.estimates[:-1]:
        kl = sequence_mean_kl(estimate["kl"], estimate["action_mask"])
        error = min(max(kl / target - 1.0, -0.2), 0.2)
        expected.append(expected[-1] * (1.0 + error * ROLLOUT_ROWS / horizon))
    assert expected[1] == pytest.approx(beta * (1 - 0.2 * ROLLOUT_ROWS / horizon))
    assert expected[2] == pytest.approx(expected[1] * (1 + 0.1 * ROLLOUT_ROWS / horizon), rel=1e-4)
    assert [e["kl_coef"] for e in recorder.estimates] == pytest.approx(expected, rel=1e-9)
    assert [m["kl/beta"] for m in metrics] == pytest.approx(expected, rel=1e-9)


def test_adaptive_beta_reaches_the_next_steps_loss(tiny_model_dir, task, reward, tmp_path, plugins):
    """With KL in the loss, the β of step s's KL term is the controller's after step s − 1 (the
    ``kl/beta`` of that step's metrics), not the preset's fixed β: step s's gradient is that of
    token_mean(−Â·ρ) + β_s·token_mean(k3), computed here from the recorded weights."""
    recorder = Recorder()
    plugins.register(recording_plugin())
    plugins.register(recorder.module())
    RecordingBackend.clear()
    train_cli(plugins, tiny_model_dir, task, reward, tmp_path / "run", "--algo", "reinforce_pp", "--advantage",
              "recorded", "--kl-in", "loss", "--kl-estimator", "k3", "--kl-coef", "0.5", "--kl-target", "1e-6",
              "--kl-horizon", "1", "--backend", "recording", "--lr", "0.5", "--train-batch-size", str(ROLLOUT_ROWS),
              "--steps", "3")
    betas = [m["kl/beta"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert betas[0] == 0.5 and abs(betas[2] - betas[0]) > 0.1  # the controller moved β
    policy = Policy(tiny_model_dir)
    step = 2
    input_ids, attention, action_mask = padded(recorder.trajectories[step])  # (B, T), (B, T), (B, A)
    with torch.no_grad():
        reference = policy.set(RecordingBackend.weights[0]).logprobs(input_ids, attention)  # (B, A)
    trained = policy.set(RecordingBackend.weights[step]).logprobs(input_ids, attention)  # (B, A), with grad
    delta = trained - reference  # (B, A)
    k3 = (torch.exp(-delta) - 1 + delta).clamp(-10, 10)  # (B, A)
    loss = ppo_loss(trained, trained.detach(), recorder.estimates[step]["advantages"], action_mask) \
        + betas[step] * (k3 * action_mask).sum() / action_mask.sum()
    assert_same_gradients(RecordingBackend.steps[step], policy.gradient(loss), atol=1e-5)


# --- c. an --async checkpoint while generation lags ---------------------------------------------

UNTIMED = ("time/", "throughput/", "async/wait_s", "async/idle_s")


def untimed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if not k.startswith(UNTIMED)} for row in rows]


def test_async_checkpoint_while_generation_lags_resumes_exactly(tiny_model_dir, task, reward, tmp_path, plugins,
                                                               make_plugin):
    """--max-staleness 2, generation slower than training: the batch of step 3 (numbered from 0)
    is still being made when the checkpoint after two steps (``step_2``) is written. The
    checkpoint must wait for it and hold it (with batch 2, and the random state after both), so a
    run killed there and resumed trains on the same batches and ends with the same metrics,
    samples and weights, bit for bit. A checkpoint that did not wait (or a resume that did not
    restore the in-flight batches) would regenerate them from newer weights, or mid-way through
    the random stream."""
    staleness = 2
    options = ["--lr", "1e-2", "--steps", "5", "--save-every", "2", "--async", "--max-staleness", str(staleness)]
    lag = ProducerLag(staleness, delay_s=0.2)
    plugins.register(lag.module())

    assert train_cli(plugins, tiny_model_dir, task, reward, tmp_path / "straight", *options) == 0
    straight = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    assert [m["async/version"] for m in straight] == [0, 0, 0, 1, 2]

    @rlhf.hookimpl(trylast=True)  # after the lag plugin has seen the checkpoint
    def killed_after_the_checkpoint(step):
        if step == 2:
            raise KeyboardInterrupt

    plugins.register(make_plugin("killer", on_checkpoint=killed_after_the_checkpoint))
    lag.checkpoint_waits.clear()
    assert train_cli(plugins, tiny_model_dir, task, reward, tmp_path / "resumed", *options) == 130
    plugins.unregister("killer")
    # batch 3 was released when the second step ended and took 0.2 s more: the checkpoint waited for it
    assert lag.checkpoint_waits[2] >= 0.2
    inflight = json.loads((tmp_path / "resumed" / "checkpoints" / "step_2" / "in_flight" / "inflight.json").read_text())
    assert [(batch["step"], batch["version"]) for batch in inflight] == [(2, 0), (3, 1)]

    assert train_cli(plugins, tiny_model_dir, task, reward, tmp_path / "resumed", *options, "--resume") == 0
    assert untimed(read_jsonl(tmp_path / "resumed" / "metrics.jsonl")) == untimed(straight)
    assert read_jsonl(tmp_path / "resumed" / "samples.jsonl") == read_jsonl(tmp_path / "straight" / "samples.jsonl")
    resumed_weights = final_weights(tmp_path / "resumed")
    for name, weight in final_weights(tmp_path / "straight").items():
        assert torch.equal(resumed_weights[name], weight), name
