"""The failure policies, ``--on-failure retry|drop-group|mask`` (rlhf/runtime/rl/failures.py), piece by
piece with a rollout that fails on cue: which samples are generated again and from which seeds,
which groups leave the batch, what the batch's sample mask and rewards then are, and the outcome
metrics. The runs through ``rlhf train`` are tests/runtime/test_outcomes_runs.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.core.distributed import DistContext
from rlhf.core.errors import ConfigError, RlhfError
from rlhf.core.outcomes import fail_trajectory
from rlhf.core.rewards import RewardResult
from rlhf.runtime.rl.batches import BatchSteps
from rlhf.runtime.rl.events import Events
from rlhf.runtime.rl.failures import mark_reward_failures, outcome_metrics, policy_of, retry_seed
from rlhf.runtime.rl.scoring import Scored
from tests.runtime.test_batches import Loader, names, scoring, trajectory

pytestmark = pytest.mark.unit


class FlakyRollout:
    """Prompt ``pK``'s samples; ``fails[pK]`` of its generations fail (env_error), counting its second
    sample in the batch's call first, then each retry (a call with n = 1). Records each call's prompts,
    its random stream's seed and first draw."""

    stateful = False

    def __init__(self, fails: dict[str, int]):
        self.fails, self.calls = dict(fails), []

    def generate(self, prompts, *, n, params):
        self.calls.append((list(prompts), n, torch.initial_seed(), torch.rand(()).item()))
        out = []
        for i, p in enumerate(prompts):
            for s in range(n):
                name = f"{p}s{s}" if n > 1 else f"{p}r{len(self.calls) - 1}"
                sample = trajectory(name, group=i)
                if self.fails.get(p, 0) and (n == 1 or s == 1):
                    self.fails[p] -= 1
                    fail_trajectory(sample, "env_error", ValueError(f"{name} broke"))
                out.append(sample)
        return out


class Scores:
    """Every sample scores 1.0, except one of a prompt named in ``reward_fails`` (a reward failure)."""

    def __init__(self, reward_fails=(), on_error="fail"):
        self.reward_fails, self.on_error, self.calls = set(reward_fails), on_error, 0

    def score(self, trajectories):
        return self.judge(trajectories, self.call_rewards(trajectories))

    def call_rewards(self, trajectories):
        self.calls += 1
        bad = {i: "reward 'src' failed (exception): ValueError: no" for i, t in enumerate(trajectories)
               if t.completion_text in self.reward_fails}
        return RewardResult(total=[None if i in bad else 1.0 for i in range(len(trajectories))],
                            per_source={}, metrics={}, errors=bad)

    def judge(self, trajectories, result):
        result.assign(trajectories)
        mark_reward_failures(trajectories, result, self.on_error)
        return Scored(trajectories=trajectories, keep=[True] * (len(trajectories) // 2), metrics={})


def batch_steps(on_failure="retry", *, max_retries=2, prompts=2, scores=None, async_rollout=False, on_error="fail"):
    config = SimpleNamespace(n_samples=2, prompts_per_step=prompts, max_filter_rounds=1, max_new_tokens=4,
                             temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, seed=11, log_tokens=0,
                             on_failure=on_failure, max_retries=max_retries, async_rollout=async_rollout,
                             reward_options=SimpleNamespace(on_error=on_error))
    plan = SimpleNamespace(config=config, filters_groups=False, rollout_logprobs=False)
    events = Events(SimpleNamespace(emit=lambda event, **kwargs: None), DistContext())
    return BatchSteps(plan, scoring=scores or Scores(), loader=Loader(), pad_token_id=0, events=events)


def test_retry_generates_the_failed_sample_again_from_its_own_seed_and_leaves_the_process_stream_alone():
    torch.manual_seed(0)
    clean = FlakyRollout({})
    batch_steps().prepare(3, clean)
    after_clean = torch.rand(()).item()

    torch.manual_seed(0)
    rollout = FlakyRollout({"p1": 2})  # p1's second sample fails, and its first retry
    prepared = batch_steps().prepare(3, rollout)
    assert torch.rand(()).item() == after_clean  # the retries drew from streams of their own
    assert [(c[0], c[1]) for c in rollout.calls] == [(["p0", "p1"], 2), (["p1"], 1), (["p1"], 1)]
    # sample 3 of the batch (p1's second), step 3, round 1, attempts 1 and 2
    assert [c[2] for c in rollout.calls[1:]] == [retry_seed(11, 3, 1, 3, 1), retry_seed(11, 3, 1, 3, 2)]
    assert rollout.calls[1][3] != rollout.calls[2][3]  # a new seed: new random numbers
    assert names(prepared.trajectories) == [("p0s0", 0), ("p0s1", 0), ("p1s0", 1), ("p1r2", 1)]
    assert [t.outcome for t in prepared.trajectories] == ["ok"] * 4
    assert prepared.outcome_metrics["outcome/retries"] == 2.0
    assert prepared.outcome_metrics["outcome/env_error_rate"] == 0.0  # the step's samples as they ended
    assert torch.equal(prepared.batch.sample_mask, torch.ones(4))


def test_retry_seeds_depend_on_every_part_of_the_samples_identity():
    seeds = {retry_seed(seed, step, round_, index, attempt) for seed in (1, 2) for step in range(3)
             for round_ in (1, 2) for index in range(4) for attempt in (1, 2)}
    assert len(seeds) == 2 * 3 * 2 * 4 * 2 and all(0 <= s < 2 ** 63 for s in seeds)
    assert max(seeds) >= 2 ** 62  # the whole 63 bits used (96 seeds all below 2^62: a chance of 2^-96)
    assert retry_seed(1, 2, 1, 3, 1) == retry_seed(1, 2, 1, 3, 1)


def test_retries_spent_drop_the_group():
    rollout = FlakyRollout({"p1": 5})
    prepared = batch_steps(max_retries=2).prepare(0, rollout)
    assert len(rollout.calls) == 3  # the batch, then two retries of p1's sample
    assert names(prepared.trajectories) == [("p0s0", 0), ("p0s1", 0)]  # p1's group left the batch
    metrics = prepared.outcome_metrics
    assert metrics["outcome/retries"] == 2.0 and metrics["outcome/dropped_groups"] == 1.0
    assert metrics["outcome/env_error_rate"] == 0.25 and metrics["outcome/ok_rate"] == 0.75


def test_drop_group_removes_the_failed_samples_group_without_a_retry():
    rollout = FlakyRollout({"p0": 1})
    prepared = batch_steps("drop-group").prepare(0, rollout)
    assert len(rollout.calls) == 1
    assert names(prepared.trajectories) == [("p1s0", 0), ("p1s1", 0)]  # renumbered: the batch's group 0
    assert prepared.batch.size == 2 and torch.equal(prepared.batch.group_index, torch.tensor([0, 0]))
    assert prepared.outcome_metrics["outcome/dropped_groups"] == 1.0


def test_mask_keeps_the_group_with_the_failed_sample_masked_and_its_reward_zero():
    rollout = FlakyRollout({"p0": 1})
    scores = Scores(reward_fails={"p1s0"})
    prepared = batch_steps("mask", scores=scores).prepare(0, rollout)
    assert len(rollout.calls) == 1 and scores.calls == 1
    assert [t.outcome for t in prepared.trajectories] == ["ok", "env_error", "reward_error", "ok"]
    assert prepared.trajectories[1].error == "ValueError: p0s1 broke"
    assert prepared.trajectories[2].error == "reward 'src' failed (exception): ValueError: no"
    # the env_error sample had a reward of 1.0: it never reaches the loss or the baseline as a number
    assert torch.equal(prepared.batch.sample_mask, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert torch.equal(prepared.batch.rewards, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert torch.equal(prepared.batch.loss_mask.sum(dim=1) > 0, torch.tensor([True, False, False, True]))
    metrics = prepared.outcome_metrics
    assert metrics["outcome/env_error_rate"] == metrics["outcome/reward_error_rate"] == 0.25
    assert metrics["outcome/dropped_groups"] == 0.0 and metrics["outcome/retries"] == 0.0


def test_scoring_gives_a_failed_sample_no_reward_and_no_score_for_shapings_and_filters():
    seen = []

    def shaping(trajectories, totals, config):
        seen.append(list(totals))
        return totals, {}

    def sample_filter(groups, config):
        seen.append([[t.score for t in g] for g in groups])
        return [True] * len(groups)

    batch = [trajectory(c) for c in "abcd"]
    fail_trajectory(batch[1], "env_error", "broke")
    judged = scoring([("s", shaping, None)], sample_filter).judge(
        batch, RewardResult(total=[1.0, 2.0, None, 4.0], per_source={}, metrics={}, errors={2: "reward failed"}))
    assert seen == [[1.0, None, None, 4.0], [[1.0, None], [None, 4.0]]]
    assert [t.reward for t in judged.trajectories] == [1.0, None, None, 4.0]
    assert [t.outcome for t in judged.trajectories] == ["ok", "env_error", "ok", "ok"]  # --reward-on-error raise


def test_a_reward_failure_is_retried_and_the_batch_scored_again():
    scores = Scores(reward_fails={"p0s1"})
    rollout = FlakyRollout({})
    prepared = batch_steps(scores=scores).prepare(0, rollout)
    assert scores.calls == 2 and [c[0] for c in rollout.calls] == [["p0", "p1"], ["p0"]]
    assert names(prepared.trajectories)[1] == ("p0r1", 0) and prepared.trajectories[1].outcome == "ok"


def test_a_step_where_every_group_failed_stops_with_the_first_failure():
    with pytest.raises(RlhfError, match=r"step 1: every prompt group failed \(--on-failure drop-group\); the first "
                                        r"failure: env_error: ValueError: p0s1 broke"):
        batch_steps("drop-group", prompts=1).prepare(0, FlakyRollout({"p0": 1}))


def test_async_runs_retry_as_synchronous_ones_do():
    for async_rollout in (False, True):
        torch.manual_seed(0)
        rollout = FlakyRollout({"p1": 1})
        prepared = batch_steps(async_rollout=async_rollout).prepare(0, rollout)
        assert [(c[0], c[1], c[2]) for c in rollout.calls] == [(["p0", "p1"], 2, 0),
                                                             (["p1"], 1, retry_seed(11, 0, 1, 3, 1))]
        assert names(prepared.trajectories) == [("p0s0", 0), ("p0s1", 0), ("p1s0", 1), ("p1r1", 1)]
        assert prepared.outcome_metrics["outcome/retries"] == 1.0


class Draws:
    """A context manager that records when it is entered and left (the lanes' lock in --async)."""

    def __init__(self):
        self.log = []

    def __call__(self):
        return self

    def __enter__(self):
        self.log.append("enter")

    def __exit__(self, *exc):
        self.log.append("exit")


def test_the_pipelined_stages_retry_on_the_rollout_given_inside_draws():
    steps = batch_steps(scores=Scores(reward_fails={"p1s0"}), async_rollout=True)
    torch.manual_seed(0)
    rolled = steps.end_rollout(steps.roll_out(5, FlakyRollout({"p0": 1}), version=3))  # p0s1: env_error
    assert [t.outcome for t in rolled.trajectories] == ["ok", "env_error", "ok", "ok"]
    assert rolled.items == ["p0", "p1"]
    retry, draws = FlakyRollout({}), Draws()
    prepared = steps.finish(rolled, steps.call_rewards(rolled), retry=retry, version=3, draws=draws)
    # the env failure (sample 1) and the reward failure (sample 2) generated again, each from its seed
    assert [(c[0], c[1], c[2]) for c in retry.calls] == [(["p0"], 1, retry_seed(11, 5, 1, 1, 1)),
                                                         (["p1"], 1, retry_seed(11, 5, 1, 2, 1))]
    assert draws.log == ["enter", "exit"] * 2
    assert names(prepared.trajectories) == [("p0s0", 0), ("p0r0", 0), ("p1r1", 1), ("p1s1", 1)]
    assert [t.outcome for t in prepared.trajectories] == ["ok"] * 4
    assert prepared.outcome_metrics["outcome/retries"] == 2.0
    assert prepared.outcome_metrics["outcome/dropped_groups"] == 0.0
    assert torch.equal(prepared.batch.sample_mask, torch.ones(4))
    assert torch.equal(prepared.batch.rewards, torch.ones(4))


def test_the_pipelined_stages_drop_a_group_whose_retries_all_fail():
    steps = batch_steps(max_retries=1, async_rollout=True)
    rolled = steps.end_rollout(steps.roll_out(0, FlakyRollout({"p1": 1})))
    retry = FlakyRollout({"p1": 1})  # its retry fails too
    prepared = steps.finish(rolled, steps.call_rewards(rolled), retry=retry, version=0)
    assert len(retry.calls) == 1 and names(prepared.trajectories) == [("p0s0", 0), ("p0s1", 0)]
    assert prepared.outcome_metrics["outcome/retries"] == 1.0
    assert prepared.outcome_metrics["outcome/dropped_groups"] == 1.0


def test_the_pipelined_async_stages_drop_or_mask_failed_groups_as_prepare_does():
    for policy, names_left in (("retry", [("p0s0", 0), ("p0s1", 0)]), ("drop-group", [("p0s0", 0), ("p0s1", 0)]),
                               ("mask", [("p0s0", 0), ("p0s1", 0), ("p1s0", 1), ("p1s1", 1)])):
        steps = batch_steps(policy, async_rollout=True, scores=Scores(reward_fails={"p1s0"}))
        rolled = steps.end_rollout(steps.roll_out(0, FlakyRollout({})))
        prepared = steps.finish(rolled, steps.call_rewards(rolled))
        assert names(prepared.trajectories) == names_left, policy
        assert prepared.outcome_metrics["outcome/reward_error_rate"] == 0.25
        assert prepared.outcome_metrics["outcome/dropped_groups"] == (0.0 if policy == "mask" else 1.0)
        if policy == "mask":
            assert torch.equal(prepared.batch.sample_mask, torch.tensor([1.0, 1.0, 0.0, 1.0]))


def test_reward_on_error_skip_is_fail_under_mask():
    config = SimpleNamespace(on_failure="retry", reward_options=SimpleNamespace(on_error="skip"))
    assert policy_of(config) == "mask"
    config.reward_options.on_error = "fail"
    assert policy_of(config) == "retry"
    steps = batch_steps(on_error="skip", scores=Scores(reward_fails={"p0s0"}, on_error="skip"))
    prepared = steps.prepare(0, FlakyRollout({}))
    assert [t.outcome for t in prepared.trajectories] == ["reward_error", "ok", "ok", "ok"]
    assert torch.equal(prepared.batch.sample_mask, torch.tensor([0.0, 1.0, 1.0, 1.0]))


def test_reward_failures_are_outcomes_only_under_fail_and_skip():
    for on_error, expected in (("fail", "reward_error"), ("skip", "reward_error"), ("zero", "ok"), ("raise", "ok")):
        batch = [trajectory("a"), trajectory("b")]
        mark_reward_failures(batch, RewardResult(total=[1.0, None], per_source={}, metrics={}, errors={1: "x"}),
                             on_error)
        assert [t.outcome for t in batch] == ["ok", expected], on_error
    earlier = fail_trajectory(trajectory("c"), "env_error", "first")  # the first failure is the one kept
    mark_reward_failures([earlier], RewardResult(total=[None], per_source={}, metrics={}, errors={0: "y"}), "fail")
    assert (earlier.outcome, earlier.error) == ("env_error", "first")


def test_outcome_metrics_are_rates_over_the_steps_samples():
    batch = [trajectory(c) for c in "abcd"]
    batch[0].outcome = "truncated"
    fail_trajectory(batch[1], "tool_timeout", "slow")
    metrics = outcome_metrics(batch, retries=3, dropped_groups=1)
    assert metrics["outcome/ok_rate"] == 0.5 and metrics["outcome/truncated_rate"] == 0.25
    assert metrics["outcome/tool_timeout_rate"] == 0.25 and metrics["outcome/stale_rate"] == 0.0
    assert metrics["outcome/retries"] == 3.0 and metrics["outcome/dropped_groups"] == 1.0
    assert len(metrics) == 9 + 2
    assert outcome_metrics([batch[1]])["outcome/tool_timeout_rate"] == 1.0  # one sample: a rate of 1
    assert outcome_metrics([])["outcome/ok_rate"] == 0.0  # an empty list: rates of 0, not a division by 0
    batch[2].outcome = "exploded"
    with pytest.raises(ValueError, match=r"unknown trajectory outcome\(s\) \['exploded'\]"):
        outcome_metrics(batch)


def test_the_config_checks_the_new_options(tiny_model_dir, task, tmp_path):
    from tests.helpers import small_config

    with pytest.raises(ConfigError, match="--reward-on-error skip means --on-failure mask; with --on-failure "
                                          "drop-group pass --reward-on-error fail"):
        small_config(tiny_model_dir, task, tmp_path, reward_on_error="skip", on_failure="drop-group").derived()
    with pytest.raises(ConfigError, match="--max-retries must be at least 0; got -1"):
        small_config(tiny_model_dir, task, tmp_path, max_retries=-1).derived()
    with pytest.raises(ConfigError, match="--env-timeout-s must be positive"):
        small_config(tiny_model_dir, task, tmp_path, env_timeout_s=0).derived()


def test_async_behaviour_log_probs_follow_the_samples_kept_and_retried():
    from rlhf.runtime.rl.async_generation import AsyncGeneration

    kept, dropped, retried = trajectory("kept"), trajectory("dropped"), trajectory("retried", tokens=5)
    rows = {id(kept): torch.tensor([1.0, 2.0, 0.0]), id(dropped): torch.tensor([3.0, 4.0, 0.0])}  # the lanes' (B, 3)
    copy = SimpleNamespace(logprobs=lambda batch: torch.full(tuple(batch.action_mask.shape), 7.0))
    producer = SimpleNamespace(retry_lane=SimpleNamespace(copy=copy))
    prepared = SimpleNamespace(trajectories=[retried, kept], batch=SimpleNamespace(action_mask=torch.ones(2, 4)))
    out = AsyncGeneration._kept_behaviour(producer, prepared, rows)
    # the retried sample's row from the retry copy, the kept one's as its lane computed it, the dropped one gone
    assert torch.equal(out, torch.tensor([[7.0, 7.0, 7.0, 7.0], [1.0, 2.0, 0.0, 0.0]]))


def test_a_retry_under_partial_rollouts_stamps_every_policy_token_with_the_batch_version():
    from rlhf.runtime.rl.async_generation import _Retrying

    def sample():
        out = trajectory("again", tokens=5)
        out.loss_mask = [0, 1, 1, 0, 1]  # the prompt, two policy tokens, an environment token, a policy token
        return out

    rollout = SimpleNamespace(generate=lambda prompts, *, n, params: [sample()])
    copy = SimpleNamespace(rollout=rollout)
    stamped = _Retrying(lambda: copy, 3, stamp=True).generate(["p0"], n=1, params=None)[0]
    assert stamped.token_versions == [-1, 3, 3, -1, 3]
    from rlhf.plugins.loggers.plugin import _tokens

    assert _tokens(stamped)["token_versions"] == [[3, 2], [-1, 1], [3, 1]]  # samples.jsonl: the completion's runs
    plain = _Retrying(lambda: copy, 3, stamp=False).generate(["p0"], n=1, params=None)[0]
    assert plain.token_versions is None and "token_versions" not in _tokens(plain)


class RemoteRollout(FlakyRollout):
    """A rollout role that samples in other processes (the Ray runtime's rollout actors): it seeds the
    stream there itself (``generate_seeded``); its ``generate`` must not be called for a retry."""

    def __init__(self, fails):
        super().__init__(fails)
        self.seeded = []

    def generate_seeded(self, prompts, *, n, params, seed):
        self.seeded.append(seed)
        return super().generate(prompts, n=n, params=params)


def test_a_rollout_that_samples_elsewhere_gets_the_retry_seed_to_seed_its_own_stream():
    torch.manual_seed(0)
    rollout = RemoteRollout({"p1": 1})
    prepared = batch_steps().prepare(4, rollout)
    assert rollout.seeded == [retry_seed(11, 4, 1, 3, 1)]
    # here nothing seeded: the call drew from this process's stream, after the batch's call
    assert [c[2] for c in rollout.calls] == [0, 0]
    assert names(prepared.trajectories) == [("p0s0", 0), ("p0s1", 0), ("p1s0", 1), ("p1r1", 1)]


def test_a_retry_copy_that_samples_elsewhere_is_asked_for_the_seed_and_its_tokens_stamped():
    from rlhf.runtime.rl.async_generation import _Retrying

    def sample():
        out = trajectory("again", tokens=3)
        out.loss_mask = [0, 1, 1]
        return out

    seen = []
    rollout = SimpleNamespace(generate_seeded=lambda prompts, *, n, params, seed: seen.append(seed) or [sample()])
    stamped = _Retrying(lambda: SimpleNamespace(rollout=rollout), 2, stamp=True).generate_seeded(
        ["p0"], n=1, params=None, seed=99)[0]
    assert seen == [99] and stamped.token_versions == [-1, 2, 2]
    local = SimpleNamespace(generate=lambda prompts, *, n, params: [trajectory(str(torch.rand(()).item()))])
    torch.manual_seed(5)
    before = torch.rand(()).item()
    torch.manual_seed(5)
    again = _Retrying(lambda: SimpleNamespace(rollout=local), 2, stamp=False).generate_seeded(
        ["p0"], n=1, params=None, seed=7)[0]
    assert torch.rand(()).item() == before  # the process's stream as it was
    torch.manual_seed(7)
    assert again.completion_text == str(torch.rand(()).item())  # sampled from the retry's seed


def test_the_retry_copy_is_the_runtime_s_own_kind_and_takes_the_version_each_batch_asks_for():
    from rlhf.runtime.rl.async_generation import AsyncGeneration, AsyncParts

    class Copy:
        def __init__(self):
            self.loaded = []

        def load(self, snapshot):
            self.loaded.append(snapshot)

    def lanes_kind():
        raise AssertionError("a retry copy is made with make_retry_copy where the runtime gives one")

    for parts in (AsyncParts(snapshot=None, make_copy=lanes_kind, make_retry_copy=Copy),
                  AsyncParts(snapshot=None, make_copy=Copy)):
        producer = SimpleNamespace(retry_lane=None, parts=parts, _snapshot_of=lambda version: f"weights {version}")
        copies = [AsyncGeneration._retry_copy(producer, version) for version in (1, 1, 0, 2)]
        assert all(c is copies[0] for c in copies)  # made once, at the first retry
        assert copies[0].loaded == ["weights 1", "weights 0", "weights 2"]  # loaded when the version changes
