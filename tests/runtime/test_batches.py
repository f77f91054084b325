"""Batch making and the roles that hide the ranks, piece by piece against hand-computed answers:
`regroup` (shards back in prompt order), `RankedRollout` and `ScoredOnMain` (a launcher's ranks),
`Events` (the main rank speaks), `Scoring` (shaping in order, the filter's verdict), `BatchSteps`
(filter rounds, the prompt multiple, the events, the pipelined stages giving the whole batch),
`StepGuards`, and the trainer staying the step (at most 15 methods). The runs themselves are
tests/runtime/test_async.py, test_rl_extensions.py and test_data_parallel.py."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhf.core.distributed import DistContext
from rlhf.core.errors import RlhfError
from rlhf.core.rewards import RewardResult
from rlhf.core.types import Trajectory, groups_of, number_groups
from rlhf.runtime.rl.batches import BatchSteps, SyncBatches
from rlhf.runtime.rl.events import Events
from rlhf.runtime.rl.guards import StepGuards
from rlhf.runtime.rl.ranks import RankedRollout, ScoredOnMain, on_ranks, regroup
from rlhf.runtime.rl.scoring import Scored, Scoring

pytestmark = pytest.mark.unit


def trajectory(name: str, group: int = -1, tokens: int = 3) -> Trajectory:
    return Trajectory(token_ids=list(range(1, tokens + 1)), loss_mask=[0] + [1] * (tokens - 1), prompt_length=1,
                      prompt=name, prompt_text=name, completion_text=name, group=group)


def names(trajectories: list[Trajectory]) -> list[tuple[str, int]]:
    return [(t.completion_text, t.group) for t in trajectories]


class FakeDist(DistContext):
    """Rank ``rank`` of ``world_size``; ``all_gather`` answers ``others`` with this rank's object in its place,
    ``broadcast`` the main rank's object (``sent`` off the main rank)."""

    def __init__(self, rank: int, world_size: int, others: list | None = None, sent: object = None):
        super().__init__(rank=rank, world_size=world_size)
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "others", others)
        object.__setattr__(self, "sent", sent)

    def all_gather(self, obj):
        self.calls.append(("all_gather", obj))
        return [obj if r == self.rank else self.others[r] for r in range(self.world_size)]

    def broadcast(self, obj, src=0):
        self.calls.append(("broadcast", obj))
        return obj if self.is_main else self.sent


# --- the ranks ---------------------------------------------------------------------------------


def test_groups_of_and_number_groups():
    batch = [trajectory(c) for c in "abcdef"]
    assert [[t.completion_text for t in g] for g in groups_of(batch, 2)] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert names(number_groups([batch[4:6], batch[0:2]])) == [("e", 0), ("f", 0), ("a", 1), ("b", 1)]


def test_regroup_puts_shards_back_in_prompt_order_with_groups_numbered_over_the_batch():
    # prompts p0..p4 over two shards: shard 0 had p0, p2, p4, shard 1 p1, p3 (n = 2 samples each)
    shard0 = [trajectory(f"p{p}s{s}", group=i) for i, p in enumerate((0, 2, 4)) for s in range(2)]
    shard1 = [trajectory(f"p{p}s{s}", group=i) for i, p in enumerate((1, 3)) for s in range(2)]
    assert names(regroup([shard0, shard1], 2, 5)) == [(f"p{p}s{s}", p) for p in range(5) for s in range(2)]
    with pytest.raises(AssertionError, match="4 prompt groups came back for 5 prompts"):
        regroup([shard0[:4], shard1], 2, 5)


def test_a_ranked_rollout_generates_its_share_and_returns_every_ranks_trajectories():
    seen = {}

    class Inner:
        stateful = True
        synced = saved = loaded = None

        def generate(self, prompts, *, n, params):
            seen["prompts"], seen["n"], seen["params"] = prompts, n, params
            return [trajectory(f"{p}s{s}", group=i) for i, p in enumerate(prompts) for s in range(n)]

        def sync_weights(self):
            self.synced = True

        def save(self, directory):
            self.saved = directory

        def load(self, directory):
            self.loaded = directory

    rank0 = [trajectory(f"{p}s{s}", group=i) for i, p in enumerate(("a", "c")) for s in range(2)]
    dist = FakeDist(rank=1, world_size=2, others=[rank0, None])
    inner = Inner()
    rollout = RankedRollout(inner, dist)
    got = rollout.generate(["a", "b", "c"], n=2, params="params")
    assert seen == {"prompts": ["b"], "n": 2, "params": "params"}  # rank 1's share: prompt 1
    assert names(got) == [("as0", 0), ("as1", 0), ("bs0", 1), ("bs1", 1), ("cs0", 2), ("cs1", 2)]
    assert rollout.stateful is True
    rollout.sync_weights()
    rollout.save(Path("x"))
    rollout.load(Path("y"))
    assert (inner.synced, inner.saved, inner.loaded) == (True, Path("x"), Path("y"))


def test_scored_on_main_scores_on_the_main_rank_and_every_rank_gets_its_answer():
    class Scorer:
        def __init__(self):
            self.calls = []

        def score(self, trajectories):
            self.calls.append(trajectories)
            return "verdict"

    scorer, main = Scorer(), FakeDist(rank=0, world_size=2)
    assert ScoredOnMain(scorer, main).score(["t"]) == "verdict"
    assert scorer.calls == [["t"]] and main.calls == [("broadcast", "verdict")]
    other = FakeDist(rank=1, world_size=2, sent="the main rank's")
    assert ScoredOnMain(None, other).score(["t"]) == "the main rank's"  # never builds nor calls a scorer
    assert other.calls == [("broadcast", None)]


def test_on_ranks_gives_the_loop_roles_that_share_the_prompts_and_score_on_the_main_rank():
    from rlhf.runtime.rl.trainer import Workers

    rollout, reward, scoring_ = SimpleNamespace(stateful=False), SimpleNamespace(), SimpleNamespace()
    dist = FakeDist(rank=1, world_size=4)
    workers = Workers(policy=None, rollout=rollout, reward=reward, scoring=scoring_, loader=None, pad_token_id=0,
                      export=None, dist=dist)
    ranked = on_ranks(workers)
    assert isinstance(ranked.rollout, RankedRollout) and ranked.rollout.rollout is rollout
    assert isinstance(ranked.reward, ScoredOnMain) and ranked.reward.scorer is reward
    assert isinstance(ranked.scoring, ScoredOnMain) and ranked.scoring.scorer is scoring_
    assert ranked.rollout.dist is ranked.reward.dist is ranked.scoring.dist is dist
    assert ranked.prompt_multiple == 4 and workers.prompt_multiple == 1  # a new Workers: the given one unchanged
    ringed = FakeDist(rank=1, world_size=4)  # in rings of 2 ranks: two data-parallel ranks
    object.__setattr__(ringed, "ring", SimpleNamespace(size=2))
    assert on_ranks(Workers(policy=None, rollout=rollout, reward=reward, scoring=scoring_, loader=None,
                            pad_token_id=0, export=None, dist=ringed)).prompt_multiple == 2


def test_only_the_main_rank_fires_events_and_warns(caplog):
    fired = []
    plugins = SimpleNamespace(emit=lambda event, **kwargs: fired.append((event, kwargs)))
    main, other = Events(plugins, FakeDist(0, 2)), Events(plugins, FakeDist(1, 2))
    main.run = other.run = "run"
    with caplog.at_level(logging.WARNING):
        for events in (main, other):
            events.emit("on_rewards", step=3)
            events.warn("step %d: %s", 4, "careful")
    assert fired == [("on_rewards", {"run": "run", "step": 3})]
    assert caplog.text.count("step 4: careful") == 1


# --- scoring -----------------------------------------------------------------------------------


def scoring(shapings=(), sample_filter=None, n_samples=2, reward=None) -> Scoring:
    config = SimpleNamespace(n_samples=n_samples, reward_options=SimpleNamespace(on_error="raise"))
    plan = SimpleNamespace(config=config,
                           choices={"sample_filter": SimpleNamespace(name="my_filter" if sample_filter else "")},
                           sample_filter=lambda: (sample_filter, "filter config") if sample_filter else None,
                           reward_shapings=lambda plugins: list(shapings))
    return Scoring(plan, None, reward)


def result(totals: list) -> RewardResult:
    return RewardResult(total=totals, per_source={"src": totals}, metrics={"reward/src/mean": 1.5})


def test_scoring_shapes_in_order_and_asks_the_filter_per_prompt_group():
    seen = []

    def plus_one(trajectories, totals, config):
        seen.append(("plus_one", list(totals), config))
        return [None if t is None else t + 1 for t in totals], {"shaping/plus_one": 1.0}

    def doubled(trajectories, totals, config):
        seen.append(("doubled", list(totals), config))
        return [None if t is None else 2 * t for t in totals], {"shaping/doubled": 2.0}

    def second_group_only(groups, config):
        seen.append(("filter", [[t.completion_text for t in g] for g in groups], config))
        return [0, 1]

    batch = [trajectory(c) for c in "abcd"]
    scored = scoring([("plus_one", plus_one, "c1"), ("doubled", doubled, "c2")], second_group_only).judge(
        batch, result([1.0, None, 3.0, 0.5]))
    assert seen == [("plus_one", [1.0, None, 3.0, 0.5], "c1"), ("doubled", [2.0, None, 4.0, 1.5], "c2"),
                    ("filter", [["a", "b"], ["c", "d"]], "filter config")]
    assert [t.reward for t in scored.trajectories] == [4.0, None, 8.0, 3.0]
    assert [t.score for t in batch] == [1.0, None, 3.0, 0.5]  # what filters compare: before shaping
    assert scored.keep == [False, True]
    assert scored.metrics == {"reward/src/mean": 1.5, "shaping/plus_one": 1.0, "shaping/doubled": 2.0}


def test_scoring_refuses_a_shaping_or_a_filter_that_answers_for_a_different_number():
    batch = [trajectory(c) for c in "abcd"]
    short = ("short", lambda trajectories, totals, config: (totals[:3], {}), None)
    with pytest.raises(RlhfError, match="reward shaping 'short' returned 3 rewards for 4 trajectories"):
        scoring([short]).judge(batch, result([1.0] * 4))
    with pytest.raises(RlhfError, match="sample filter 'my_filter' returned 1 flags for 2 prompt groups"):
        scoring(sample_filter=lambda groups, config: [True]).judge(batch, result([1.0] * 4))
    assert scoring().judge(batch, result([1.0] * 4)).keep == [True, True]  # no filter: every group


def test_score_is_the_reward_call_then_the_judgement():
    batch = [trajectory(c) for c in "ab"]
    reward = SimpleNamespace(score=lambda trajectories: result([0.25, 0.75]))
    scored = scoring(reward=reward).score(batch)
    assert [t.reward for t in scored.trajectories] == [0.25, 0.75] and scored.keep == [True]


# --- batch making ------------------------------------------------------------------------------


class Loader:
    def __init__(self):
        self.drawn = 0

    def next_batch(self, size):
        self.drawn += size
        return [f"p{self.drawn - size + i}" for i in range(size)]


class Rollout:
    """Prompt ``pK`` gets ``n`` samples of K + 2 tokens; it records every call."""

    stateful = False

    def __init__(self):
        self.calls = []
        self.synced = 0

    def generate(self, prompts, *, n, params):
        self.calls.append(list(prompts))
        return [trajectory(f"{p}s{s}", group=i, tokens=int(p[1:]) + 2) for i, p in enumerate(prompts) for s in range(n)]

    def sync_weights(self):
        self.synced += 1


class KeepEvenPrompts:
    """Scores each sample 1.0 (its second sample of odd prompts: None); ``filtering``, it keeps the groups
    of even prompts."""

    def __init__(self, filtering: bool):
        self.filtering = filtering

    def call_rewards(self, trajectories):
        return result([None if t.completion_text.endswith("s1") and int(t.completion_text[1:-2]) % 2 else 1.0
                       for t in trajectories])

    def judge(self, trajectories, rewards):
        rewards.assign(trajectories)
        keep = [not self.filtering or int(g[0].completion_text[1:-2]) % 2 == 0 for g in groups_of(trajectories, 2)]
        return Scored(trajectories=trajectories, keep=keep, metrics={"reward/total/mean": float(len(trajectories))})

    def score(self, trajectories):
        return self.judge(trajectories, self.call_rewards(trajectories))


def batch_steps(*, filters=True, rounds=3, prompts=3, multiple=1, fired=None):
    config = SimpleNamespace(n_samples=2, prompts_per_step=prompts, max_filter_rounds=rounds, max_new_tokens=4,
                             temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, seed=0, on_failure="retry",
                             log_tokens=0,
                             max_retries=2, async_rollout=False, reward_options=SimpleNamespace(on_error="raise"))
    plan = SimpleNamespace(config=config, filters_groups=filters, rollout_logprobs=False)
    fired = [] if fired is None else fired
    plugins = SimpleNamespace(emit=lambda event, **kwargs: fired.append((event, kwargs)))
    events = Events(plugins, DistContext())
    return BatchSteps(plan, scoring=KeepEvenPrompts(filters), loader=Loader(), pad_token_id=0, events=events,
                      prompt_multiple=multiple)


def test_a_filtered_batch_samples_rounds_until_enough_groups_pass(caplog):
    fired = []
    steps, rollout = batch_steps(fired=fired), Rollout()
    prepared = steps.prepare(5, rollout)
    # round 1: p0 p1 p2 (p0, p2 kept); round 2: p3 (dropped); round 3: p4 (kept): 3 of 3
    assert rollout.calls == [["p0", "p1", "p2"], ["p3"], ["p4"]]
    assert names(prepared.trajectories) == [("p0s0", 0), ("p0s1", 0), ("p2s0", 1), ("p2s1", 1), ("p4s0", 2),
                                            ("p4s1", 2)]
    assert prepared.step == prepared.version == 5
    # counts summed, means weighted by each round's samples (6, 2, 2): all 6.0, 2.0, 2.0 -> 4.4
    assert prepared.reward_metrics == {"reward/total/mean": pytest.approx(4.4), "filter/rounds": 3.0,
                                       "filter/dropped_groups": 2.0, "filter/kept_groups": 3.0,
                                       "filter/sampled_groups": 5.0, "filter/pass_rate": 3 / 5}
    assert [event for event, _ in fired] == ["on_rollout_end"] * 3 + ["on_rewards"]
    assert fired[-1][1]["step"] == 5 and torch.equal(fired[-1][1]["rewards"], torch.ones(6))
    assert prepared.batch.input_ids.shape == (6, 6) and torch.equal(prepared.batch.group_index,
                                                                    torch.tensor([0, 0, 1, 1, 2, 2]))
    assert set(prepared.seconds) == {"rollout", "reward", "experience"}
    assert "prompt groups passed" not in caplog.text


def test_too_few_groups_train_on_those_kept_and_none_on_the_last_round(caplog):
    steps, rollout = batch_steps(rounds=2, prompts=3), Rollout()
    with caplog.at_level(logging.WARNING):
        prepared = steps.prepare(0, rollout)
    assert rollout.calls == [["p0", "p1", "p2"], ["p3"]] and len(prepared.trajectories) == 4
    assert "step 1: 2 of 3 prompt groups passed the sample filter in 2 rounds" in caplog.text
    assert prepared.reward_metrics["filter/kept_groups"] == 2.0
    steps, rollout = batch_steps(rounds=1, prompts=1), Rollout()
    steps.loader.drawn = 1  # the only prompt it draws is p1, which the filter drops
    with caplog.at_level(logging.WARNING):
        prepared = steps.prepare(2, rollout)
    assert "step 3: no prompt group passed the sample filter in 1 rounds" in caplog.text
    # trained unfiltered; p1's second sample has no reward: masked out of the loss
    assert names(prepared.trajectories) == [("p1s0", 0), ("p1s1", 0)]
    assert torch.equal(prepared.batch.sample_mask, torch.tensor([1.0, 0.0]))
    assert torch.equal(prepared.batch.rewards, torch.tensor([1.0, 0.0]))


def test_every_round_draws_a_multiple_of_the_prompt_multiple_and_keeps_only_what_the_step_wants():
    steps, rollout = batch_steps(prompts=4, multiple=2), Rollout()
    prepared = steps.prepare(0, rollout)
    # round 1: p0..p3 (p0, p2 kept); round 2 needs 2: p4, p5 (p4 kept); round 3 needs 1, draws 2: p6 p7
    assert rollout.calls == [["p0", "p1", "p2", "p3"], ["p4", "p5"], ["p6", "p7"]]
    assert [g[0].completion_text for g in groups_of(prepared.trajectories, 2)] == ["p0s0", "p2s0", "p4s0", "p6s0"]
    assert prepared.reward_metrics["filter/sampled_groups"] == 8.0
    steps, rollout = batch_steps(prompts=4, multiple=3), Rollout()
    prepared = steps.prepare(0, rollout)
    # round 1 needs 4, draws 6: p0..p5 (p0 p2 p4 kept); round 2 needs 1, draws 3: p6 p7 p8 (p6 p8 kept)
    assert rollout.calls == [["p0", "p1", "p2", "p3", "p4", "p5"], ["p6", "p7", "p8"]]
    assert [g[0].completion_text for g in groups_of(prepared.trajectories, 2)] == ["p0s0", "p2s0", "p4s0", "p6s0"]


def test_without_a_filter_one_round_keeps_every_group_and_reports_no_filter_metrics():
    steps, rollout = batch_steps(filters=False, prompts=2), Rollout()
    prepared = steps.prepare(0, rollout)
    assert rollout.calls == [["p0", "p1"]] and len(prepared.trajectories) == 4
    assert prepared.reward_metrics == {"reward/total/mean": 4.0}


def test_the_pipelined_stages_make_the_batch_prepare_makes():
    whole, fired_whole = batch_steps(filters=False, prompts=3), []
    whole.events.plugins = SimpleNamespace(emit=lambda event, **kwargs: fired_whole.append(event))
    expected = whole.prepare(4, Rollout())
    staged, fired_staged = batch_steps(filters=False, prompts=3), []
    staged.events.plugins = SimpleNamespace(emit=lambda event, **kwargs: fired_staged.append(event))
    rolled = staged.end_rollout(staged.roll_out(4, Rollout()))
    assert torch.equal(rolled.batch.rewards, torch.zeros(6)) and torch.equal(rolled.batch.sample_mask, torch.ones(6))
    got = staged.finish(rolled, staged.call_rewards(rolled))
    assert fired_whole == fired_staged == ["on_rollout_end", "on_rewards"]
    assert names(got.trajectories) == names(expected.trajectories) and got.step == expected.step == 4
    assert got.reward_metrics == expected.reward_metrics
    for name in ("input_ids", "attention_mask", "action_mask", "rewards", "sample_mask", "group_index"):
        assert torch.equal(getattr(got.batch, name), getattr(expected.batch, name)), name
    assert set(got.seconds) == {"rollout", "reward", "experience"}


def test_sync_batches_use_the_trainers_rollout():
    steps, rollout = batch_steps(filters=False, prompts=1), Rollout()
    batches = SyncBatches(steps, rollout)
    batches.start(0)
    assert names(batches.next(0).trajectories) == [("p0s0", 0), ("p0s1", 0)] and rollout.calls == [["p0"]]
    batches.sync_weights()
    assert rollout.synced == 1
    assert batches.checkpoint_roles() == {}
    rollout.stateful = True
    assert batches.checkpoint_roles() == {"rollout": rollout}
    state = {"rng": None}
    with batches.eval_stream(state):
        pass
    assert state == {"rng": None}


# --- guards and the trainer ------------------------------------------------------------------


def test_a_reward_that_fails_on_every_sample_warns_then_stops_the_run(caplog):
    config = SimpleNamespace(max_failed_reward_steps=2, max_nonfinite_steps=3,
                             reward_options=SimpleNamespace(on_error="zero"))
    plan = SimpleNamespace(config=config, derived=SimpleNamespace(rollout_batch_size=4))
    guards = StepGuards(plan, {}, Events(SimpleNamespace(emit=None), DistContext()))
    with caplog.at_level(logging.WARNING):
        guards.check_rewards(0, {"reward/failures/judge": 4.0, "reward/failures/other": 3.0})
        guards.check_rewards(1, {"reward/failures/judge": 3.0, "reward/judge": 1.0})  # it scored once: the count restarts
        guards.check_rewards(2, {"reward/failures/judge": 4.0})
        with pytest.raises(RlhfError, match="the reward judge failed on every sample for 2 steps in a row"):
            guards.check_rewards(3, {"reward/failures/judge": 5.0})
    assert "step 1: the reward judge failed on every sample (--reward-on-error zero); the run stops after 2" \
        in caplog.text
    assert "step 2:" not in caplog.text and "step 3: the reward judge" in caplog.text


def test_the_trainer_keeps_at_most_fifteen_methods():
    source = Path(__file__).resolve().parents[2] / "rlhf" / "runtime" / "rl" / "trainer.py"
    trainer = next(node for node in ast.parse(source.read_text()).body
                   if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    methods = [node.name for node in ast.walk(trainer) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= 15, methods
    assert "step" in methods
