"""--async: generation beside training. Exact at staleness 0, staleness bounded and deterministic,
behaviour log-probs as old_logprobs, exact resume with in-flight batches, clean shutdown on errors on
either side, and environments of a batch stepping concurrently."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.local import train
from tests.helpers import final_weights, read_jsonl, run_cli, small_config

TRAINING_KEYS = ("reward/mean", "policy/loss", "policy/grad_norm", "policy/approx_kl", "response/length_mean")


def _run(model, task, out, plugins=None, **overrides):
    train(small_config(model, task, out, **{"steps": 4, **overrides}), plugins=plugins or build_plugin_manager())
    return read_jsonl(out / "metrics.jsonl")


def _samples(out):
    return [(s["step"], s["completion"], s["reward"]) for s in read_jsonl(out / "samples.jsonl")]


def _no_producer_left():
    return not any(t.name.startswith("rlhf-async-") for t in threading.enumerate())


def _assert_same_run(out, metrics, expected_out, expected_metrics):
    """Two runs' training metrics, samples and final weights, bit for bit."""
    assert [{k: m[k] for k in TRAINING_KEYS} for m in metrics] == \
        [{k: m[k] for k in TRAINING_KEYS} for m in expected_metrics]
    assert _samples(out) == _samples(expected_out)
    for (name, a), b in zip(final_weights(expected_out).items(), final_weights(out).values()):
        assert torch.equal(a, b), name


def _killed_after_the_step_2_checkpoint(model, task, out, make_plugin, **options):
    """A run killed right after its step-2 checkpoint (batches in flight); no producer thread left."""

    def crash(step):
        if step == 2:
            raise KeyboardInterrupt

    plugins = build_plugin_manager()
    plugins.register(make_plugin("killer", on_checkpoint=crash))
    with pytest.raises(KeyboardInterrupt):
        _run(model, task, out, plugins=plugins, **options)
    assert _no_producer_left()


def assert_on_policy_only_at_first(metrics: list[dict]) -> None:
    """The first step trains on samples of the weights it starts from: its ratio is 1 up to float
    rounding (the sampler's and the training forward's log-probs of the same tokens; bit-equal on
    some CPUs, not on others); every later step trains on older samples, with a visible KL."""
    kl = [m["policy/approx_kl"] for m in metrics]
    assert abs(kl[0]) < 1e-6 and all(abs(value) > 1e-5 for value in kl[1:]), kl


@pytest.mark.run
def test_staleness_zero_is_exactly_the_synchronous_run(tiny_model_dir, task, tmp_path):
    sync = _run(tiny_model_dir, task, tmp_path / "sync")
    ahead = _run(tiny_model_dir, task, tmp_path / "async", async_rollout=True, max_staleness=0)
    assert _samples(tmp_path / "async") == _samples(tmp_path / "sync")
    assert [{k: m[k] for k in TRAINING_KEYS} for m in ahead] == [{k: m[k] for k in TRAINING_KEYS} for m in sync]
    assert all(m["async/staleness_max"] == 0 for m in ahead)
    for (name, a), b in zip(final_weights(tmp_path / "sync").items(), final_weights(tmp_path / "async").values()):
        assert torch.equal(a, b), name
    assert _no_producer_left()


@pytest.mark.run
def test_staleness_one_samples_each_batch_from_the_previous_version(tiny_model_dir, task, tmp_path):
    ahead = _run(tiny_model_dir, task, tmp_path / "async", async_rollout=True, max_staleness=1)
    assert [m["async/staleness_max"] for m in ahead] == [0, 1, 1, 1]
    assert [m["async/version"] for m in ahead] == [0, 0, 1, 2]
    # batches 0 and 1 both come from the initial weights, drawn one after the other: what a run whose
    # weights never change samples for its first two steps
    _run(tiny_model_dir, task, tmp_path / "frozen", freeze_actor_steps=2)
    assert [s for s in _samples(tmp_path / "async") if s[0] <= 2] == \
        [s for s in _samples(tmp_path / "frozen") if s[0] <= 2]
    # the loss's old_logprobs are the behaviour policy's: from step 2 the ratio to the current policy is not 1
    assert_on_policy_only_at_first(ahead)
    # and the run does not depend on timing
    again = _run(tiny_model_dir, task, tmp_path / "again", async_rollout=True, max_staleness=1)
    assert [{k: m[k] for k in TRAINING_KEYS} for m in again] == [{k: m[k] for k in TRAINING_KEYS} for m in ahead]
    assert _samples(tmp_path / "again") == _samples(tmp_path / "async")


@pytest.mark.run
@pytest.mark.parametrize("staleness", [1, 2])
def test_resume_with_batches_in_flight_reproduces_the_uninterrupted_run(tiny_model_dir, task, tmp_path, make_plugin,
                                                                        staleness):
    options = dict(steps=5, save_every=2, async_rollout=True, max_staleness=staleness)
    straight = _run(tiny_model_dir, task, tmp_path / "straight", **options)
    _killed_after_the_step_2_checkpoint(tiny_model_dir, task, tmp_path / "resumed", make_plugin, **options)
    inflight = tmp_path / "resumed" / "checkpoints" / "step_2" / "in_flight" / "inflight.json"
    assert inflight.is_file()
    if staleness == 2:  # a checkpoint from before the folder was renamed resumes the same
        inflight.parent.rename(inflight.parent.with_name("ahead"))
        (inflight.parents[1] / "MANIFEST.json").unlink()  # nor had manifests then
    resumed = _run(tiny_model_dir, task, tmp_path / "resumed", resume=True, **options)
    _assert_same_run(tmp_path / "resumed", resumed, tmp_path / "straight", straight)


@pytest.mark.run
def test_an_error_in_generation_stops_the_run_and_the_producer(tiny_model_dir, task, tmp_path):
    calls = tmp_path / "calls"
    reward = tmp_path / "failing.py"
    reward.write_text(f"""
from pathlib import Path
def reward_func(completions, **kwargs):
    path = Path({str(calls)!r})
    n = int(path.read_text()) if path.exists() else 0
    path.write_text(str(n + 1))
    if n == 2:
        raise ValueError("the reward server went away")
    return [1.0 for _ in completions]
""")
    with pytest.raises(RlhfError, match="the reward server went away"):
        _run(tiny_model_dir, task, tmp_path / "run", reward=[f"{reward}:reward_func"], async_rollout=True)
    assert _no_producer_left()


@pytest.mark.run
def test_an_error_in_training_stops_the_producer(tiny_model_dir, task, tmp_path, make_plugin):
    def explode(step):
        if step == 1:
            raise RuntimeError("a logger broke")

    plugins = build_plugin_manager()
    plugins.register(make_plugin("exploder", on_step_end=explode))
    with pytest.raises(Exception, match="a logger broke"):
        _run(tiny_model_dir, task, tmp_path / "run", plugins=plugins, async_rollout=True, max_staleness=2)
    assert _no_producer_left()


@pytest.mark.run
@pytest.mark.parametrize("filtered", [True, False], ids=["one-batch-at-a-time", "pipelined"])
def test_async_with_eval_and_filtering_stays_deterministic(tiny_model_dir, task, tmp_path, filtered):
    options = dict(async_rollout=True, max_staleness=1, eval_data=[str(task / "data.jsonl")], eval_max_samples=2,
                   eval_every=2, **(dict(filter_groups=True, max_filter_rounds=3) if filtered else {}))
    first = _run(tiny_model_dir, task, tmp_path / "a", **options)
    second = _run(tiny_model_dir, task, tmp_path / "b", **options)
    timing = ("time/", "throughput/", "async/wait", "async/idle")
    untimed = lambda rows: [{k: v for k, v in m.items() if not k.startswith(timing)} for m in rows]  # noqa: E731
    assert untimed(first) == untimed(second)
    assert [m["step"] for m in first if "eval/reward/mean" in m] == [0, 2, 4]
    # either way the loss's old_logprobs are the behaviour policy's: from step 2 the ratio is not 1
    trained = [m for m in first if "policy/approx_kl" in m]
    assert_on_policy_only_at_first(trained)


@pytest.mark.unit
def test_async_is_refused_where_it_cannot_run(tiny_model_dir, task, tmp_path, plugins):
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--reward", str(task / "rewards.py"), "--async", "--runtime", "ray", "--colocate",
                               "all", "--out", str(tmp_path / "run")])
    assert result.exit_code != 0 and "--async" in result.output and "--colocate all" in result.output
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--reward", str(task / "rewards.py"), "--async", "--max-staleness", "-1"])
    assert result.exit_code == 2 and "--max-staleness must be at least 0" in result.output


SLOW_ENV = '''
import random, threading, time
from rlhf.core.types import StepResult

ACTIVE = {"now": 0, "most": 0}
LOCK = threading.Lock()

class SlowToolEnv:
    def reset(self, prompt, label):
        self.rng = random.Random(hash(prompt))
        return None

    def step(self, action):
        with LOCK:
            ACTIVE["now"] += 1
            ACTIVE["most"] = max(ACTIVE["most"], ACTIVE["now"])
        time.sleep(self.rng.uniform(0.05, 0.3))  # a tool call of random duration
        with LOCK:
            ACTIVE["now"] -= 1
        return StepResult(reward=float(ACTIVE["most"]), done=True)
'''


@pytest.mark.run
def test_environments_of_a_batch_step_concurrently(tiny_model_dir, task, tmp_path):
    (tmp_path / "slow_env.py").write_text(SLOW_ENV)
    out = tmp_path / "run"
    executor_default = min(32, (os.cpu_count() or 1) + 4)  # what asyncio's default executor would run at once
    n_samples = (executor_default + 5) // 2
    train(small_config(tiny_model_dir, task, out, steps=1, env=f"{tmp_path / 'slow_env.py'}:SlowToolEnv",
                       reward=[], prompts_per_step=2, n_samples=n_samples, micro_batch_size=2 * n_samples),
          plugins=build_plugin_manager())
    # each step reports the most tool calls in flight so far: more ran at once than the default executor has threads
    rewards = [s["reward"] for s in read_jsonl(out / "samples.jsonl")]
    assert max(rewards) > executor_default, rewards


# A reward that holds its first call until a second one has started: the test finishes only if the
# scoring of one batch overlaps the next ones' (in a run without a pipeline it would wait its 20 s
# out and record 1). Its other calls take a random time, so batches finish scoring out of order.
SLOW_REWARD = '''
import asyncio, random, threading
from pathlib import Path

LOCK = threading.Lock()
STATE = {"calls": 0, "now": 0, "most": 0}
SECOND = threading.Event()

async def slow_reward(completions, labels, **kwargs):
    with LOCK:
        index = STATE["calls"]
        STATE["calls"] += 1
        STATE["now"] += 1
        STATE["most"] = max(STATE["most"], STATE["now"])
    if index == 0:
        await asyncio.to_thread(SECOND.wait, 20)
    else:
        SECOND.set()
        await asyncio.sleep(random.Random().uniform(0.0, 0.2))  # its own random numbers, never the run's
    with LOCK:
        STATE["now"] -= 1
        Path(__file__).with_suffix(".most").write_text(str(STATE["most"]))
    return [float(c.strip() == str(label)) + 0.1 * len(c) for c, label in zip(completions, labels)]
'''


@pytest.mark.run
def test_pipelined_runs_overlap_rewards_and_stay_deterministic_through_a_resume(tiny_model_dir, task, tmp_path,
                                                                                   make_plugin):
    def options(name):  # a reward file per run: module state (the call counter) starts afresh
        (tmp_path / f"{name}.py").write_text(SLOW_REWARD)
        return dict(steps=5, save_every=2, async_rollout=True, max_staleness=2, reward=[f"{tmp_path / name}.py:slow_reward"])

    first = _run(tiny_model_dir, task, tmp_path / "a", **options("reward_a"))
    assert int((tmp_path / "reward_a.most").read_text()) >= 2  # batches scored at once
    second = _run(tiny_model_dir, task, tmp_path / "b", **options("reward_b"))
    assert [m["async/staleness_max"] for m in first] == [0, 1, 2, 2, 2]
    _assert_same_run(tmp_path / "b", second, tmp_path / "a", first)
    _killed_after_the_step_2_checkpoint(tiny_model_dir, task, tmp_path / "c", make_plugin, **options("reward_c"))
    resumed = _run(tiny_model_dir, task, tmp_path / "c", resume=True, **options("reward_c"))
    _assert_same_run(tmp_path / "c", resumed, tmp_path / "a", first)


@pytest.mark.run
@pytest.mark.parametrize("staleness, producer, trainer", [(0, 2, 2), (1, 1, 1)])
def test_producer_and_trainer_split_the_threads_when_they_overlap(tiny_model_dir, task, tmp_path, make_plugin,
                                                                  staleness, producer, trainer):
    seen = {"rollout": set(), "step": set(), "end": set()}
    plugins = build_plugin_manager()
    plugins.register(make_plugin("threads_seen",
                                 on_rollout_end=lambda: seen["rollout"].add(torch.get_num_threads()),  # producer
                                 on_step_end=lambda: seen["step"].add(torch.get_num_threads()),  # trainer
                                 on_run_end=lambda: seen["end"].add(torch.get_num_threads())))  # producer stopped
    before = torch.get_num_threads()
    _run(tiny_model_dir, task, tmp_path / "run", plugins=plugins, steps=2, threads=2, async_rollout=True,
         max_staleness=staleness)
    assert seen == {"rollout": {producer}, "step": {trainer}, "end": {2}}  # the trainer's share given back
    torch.set_num_threads(before)


# A multi-turn environment whose very first tool call returns only once a trajectory of a later batch
# has started (a third distinct prompt: a batch holds two): with continuous batching the rollouts of
# several batches overlap (generation lanes), so the run does not wait its 20 s out. Its other tool
# calls take a random time, so trajectories and batches finish in a different order every run.
GATED_TOOLS = '''
import random, threading, time
from pathlib import Path
from rlhf.core.types import StepResult

GATE = {gate}
LOCK = threading.Lock()
STATE = {{"resets": 0, "prompts": set()}}
LATER_BATCH = threading.Event()


class GatedTools:
    def reset(self, prompt, label):
        with LOCK:
            self.first = STATE["resets"] == 0
            STATE["resets"] += 1
            STATE["prompts"].add(str(prompt))
            if len(STATE["prompts"]) > 2:
                LATER_BATCH.set()
        self.turns = 0
        return None

    def step(self, action):
        self.turns += 1
        if GATE and self.first and self.turns == 1:
            Path(__file__).with_suffix(".opened").write_text(str(LATER_BATCH.wait(20)))
        else:
            time.sleep(random.Random().uniform(0.0, 0.05))  # its own random numbers, never the run's
        return StepResult(observation=" ok", reward=float(len(action) % 3), done=self.turns >= 2)
'''


@pytest.mark.run
def test_continuous_rollouts_of_several_batches_overlap_and_stay_deterministic_through_a_resume(
        tiny_model_dir, task, tmp_path, make_plugin):
    def options(name, gate=True):  # an env file per run: module state starts afresh
        (tmp_path / f"{name}.py").write_text(GATED_TOOLS.format(gate=gate))
        return dict(steps=5, save_every=2, async_rollout=True, max_staleness=2, max_turns=2, reward=[],
                    env=f"{tmp_path / name}.py:GatedTools")

    first = _run(tiny_model_dir, task, tmp_path / "a", **options("tools_a"))
    assert (tmp_path / "tools_a.opened").read_text() == "True"  # batch 1 started while batch 0 waited on a tool
    assert [m["async/staleness_max"] for m in first] == [0, 1, 2, 2, 2]
    assert all(m["env/turns_mean"] > 1 for m in first)
    # the lanes' behaviour log-probs are the loss's old_logprobs: from step 2 the ratio is not 1
    assert_on_policy_only_at_first(first)
    second = _run(tiny_model_dir, task, tmp_path / "b", **options("tools_b"))
    _assert_same_run(tmp_path / "b", second, tmp_path / "a", first)
    _killed_after_the_step_2_checkpoint(tiny_model_dir, task, tmp_path / "c", make_plugin, **options("tools_c"))
    resumed = _run(tiny_model_dir, task, tmp_path / "c", resume=True, **options("tools_c", gate=False))
    _assert_same_run(tmp_path / "c", resumed, tmp_path / "a", first)


@pytest.mark.run
def test_k_plus_one_lanes_compute_exactly_what_one_lane_computes(tiny_model_dir, task, tmp_path, monkeypatch):
    """With continuously batched multi-turn rollouts the producer runs K + 1 lanes (batch j waits only
    for version j - K); tools of random duration reorder what finishes first, never what is computed."""
    from rlhf.runtime.rl import async_generation

    lanes_used = []
    real_init = async_generation.AsyncGeneration.__init__

    def init(self, *args, forced=None, **kwargs):
        real_init(self, *args, **{**kwargs, **({"lanes": forced} if forced else {})})
        lanes_used.append(self.lanes)

    def options(name):
        (tmp_path / f"{name}.py").write_text(GATED_TOOLS.format(gate=False))
        return dict(steps=4, async_rollout=True, max_staleness=2, max_turns=2, reward=[],
                    env=f"{tmp_path / name}.py:GatedTools")

    monkeypatch.setattr(async_generation.AsyncGeneration, "__init__", init)
    several = _run(tiny_model_dir, task, tmp_path / "several", **options("tools_several"))
    monkeypatch.setattr(async_generation.AsyncGeneration, "__init__",
                        lambda self, *a, **k: init(self, *a, forced=1, **k))
    one = _run(tiny_model_dir, task, tmp_path / "one", **options("tools_one"))
    assert lanes_used == [3, 1]
    _assert_same_run(tmp_path / "several", several, tmp_path / "one", one)
