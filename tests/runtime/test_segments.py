"""Segments (an agent trajectory of several sequences): after the advantages, each extra sequence is a
row of its own with its trajectory's reward, sample mask, group and advantage, its old and reference
log-probs and KL computed like any row's; minibatches count trajectories and keep their rows together."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.batch import collate
from rlhf.core.types import Trajectory
from rlhf.runtime.step.micro_batches import UpdateSettings, minibatches
from rlhf.runtime.step.segments import record_behaviour, with_segments

pytestmark = pytest.mark.unit

PAD = 0


def row(tokens: list[int], mask: list[int], group: int = 0, segments=()) -> Trajectory:
    return Trajectory(token_ids=tokens, loss_mask=mask, prompt_length=mask.index(1), prompt="p", prompt_text="p",
                      completion_text="c", group=group, rollout_logprobs=[-0.5 * m for m in mask],
                      segments=list(segments))


class Logprobs:
    """A role whose log-probs are -(token id) / 10 at every action position (so they say which row they are)."""

    def __init__(self):
        self.seen = []

    def logprobs(self, batch):
        self.seen.append(batch.size)
        return -batch.input_ids[:, 1:].float() / 10 * batch.action_mask  # (B, A)


class K1:
    obj = staticmethod(lambda logprobs, ref: logprobs - ref)


def experienced(trajectories, rewards):
    batch = collate(trajectories, pad_token_id=PAD, rewards=torch.tensor(rewards), sample_mask=torch.ones(len(rewards)))
    old = Logprobs().logprobs(batch)
    advantages = torch.tensor([0.7, -0.7])[:, None] * batch.action_mask  # (B, A)
    from dataclasses import replace

    return replace(batch, old_logprobs=old, ref_logprobs=old - 0.25 * batch.action_mask, kl=0.25 * batch.action_mask,
                   advantages=advantages, returns=advantages + 1.0 * batch.action_mask)


def test_each_segment_is_a_row_with_its_trajectorys_reward_and_advantage():
    segment = row([5, 6, 7, 8, 9, 4], [0, 0, 1, 1, 0, 1])
    trajectories = [row([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], segments=[segment]), row([1, 2, 3, 4], [0, 0, 1, 1])]
    batch = experienced(trajectories, [1.0, 0.0])
    policy, reference = Logprobs(), Logprobs()
    out = with_segments(batch, trajectories, pad_token_id=PAD, policy=policy, reference=reference, kl_estimator=K1)
    assert out.size == 3 and policy.seen == [1] and reference.seen == [1]  # the segment's forwards only
    assert out.trajectory_index.tolist() == [0, 1, 0] and out.group_index.tolist() == [0, 0, 0]
    assert out.rewards.tolist() == [1.0, 0.0, 1.0] and out.sample_mask.tolist() == [1.0, 1.0, 1.0]
    assert out.input_ids.tolist() == [[1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 4]]
    assert out.action_mask[2].tolist() == [0, 1, 1, 0, 1]
    # the trajectory's advantage (its first action token's, 0.7) on every action token of its segment
    assert out.advantages[2].tolist() == pytest.approx([0.0, 0.7, 0.7, 0.0, 0.7])
    assert out.returns[2].tolist() == pytest.approx([0.0, 1.7, 1.7, 0.0, 1.7])
    assert out.advantages[:2, :4].tolist() == batch.advantages.tolist() and not out.advantages[:2, 4].any()
    assert out.old_logprobs[2].tolist() == pytest.approx([0.0, -0.7, -0.8, 0.0, -0.4])
    assert out.kl[2].tolist() == pytest.approx([0.0] * 5)  # policy and reference agree here
    assert out.rollout_logprobs[2].tolist() == pytest.approx([0.0, -0.5, -0.5, 0.0, -0.5])


class Behaviour:
    """The copy that sampled (--async, K > 0): log-probs -(token id) / 100, so they differ from `Logprobs`'."""

    def __init__(self):
        self.seen = []

    def logprobs(self, batch):
        self.seen.append(batch.size)
        return -batch.input_ids[:, 1:].float() / 100 * batch.action_mask  # (B, A)


def test_under_async_a_segments_old_logprobs_are_the_copy_that_sampled_it_not_the_trainers():
    segment = row([5, 6, 7, 8, 9, 4], [0, 0, 1, 1, 0, 1])
    other = row([3, 7], [0, 1])
    trajectories = [row([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], segments=[segment, other]), row([1, 2, 3, 4], [0, 0, 1, 1])]
    copy = Behaviour()
    record_behaviour(trajectories, PAD, copy.logprobs)  # by the producer, with the copy of the batch's version
    assert copy.seen == [2]  # one forward over the segments only
    assert segment.behaviour_logprobs == pytest.approx([0.0, 0.0, -0.07, -0.08, 0.0, -0.04])
    assert other.behaviour_logprobs == pytest.approx([0.0, -0.07])
    assert trajectories[0].behaviour_logprobs is None  # the trajectories' rows have the batch's old_logprobs
    policy = Logprobs()
    out = with_segments(experienced(trajectories, [1.0, 0.0]), trajectories, pad_token_id=PAD, policy=policy,
                        reference=Logprobs(), kl_estimator=K1)
    assert policy.seen == []  # the trainer's weights (newer) compute none of them
    assert out.old_logprobs[2].tolist() == pytest.approx([0.0, -0.07, -0.08, 0.0, -0.04])
    assert out.old_logprobs[3].tolist() == pytest.approx([-0.07, 0.0, 0.0, 0.0, 0.0])
    record_behaviour([row([1, 2], [0, 1])], PAD, copy.logprobs)  # no segments: no forward
    assert copy.seen == [2]


def test_with_a_teacher_each_segment_token_gets_its_own_term_on_the_tasks_advantage():
    from dataclasses import replace

    from rlhf.algorithms.distillation import teacher_advantages

    segment = row([5, 6, 7, 8, 9, 4], [0, 0, 1, 1, 0, 1])
    trajectories = [row([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], segments=[segment]), row([1, 2, 3, 4], [0, 0, 1, 1])]
    batch = experienced(trajectories, [1.0, 0.0])  # the task's advantages 0.7 and -0.7; old -(id) / 10
    tea = Behaviour().logprobs(batch)  # the teacher's: -(id) / 100
    batch = replace(batch, teacher_logprobs=tea,  # as the experience maker leaves it: the teacher's term added
                    advantages=batch.advantages + teacher_advantages(batch.old_logprobs, tea, batch.loss_mask, coef=0.5))
    assert batch.advantages[0, 2].item() == pytest.approx(0.7 + 0.18)  # -0.5 * (-0.4 + 0.04) at its first token
    teacher = Behaviour()
    out = with_segments(batch, trajectories, pad_token_id=PAD, policy=Logprobs(), reference=Logprobs(),
                        kl_estimator=K1, teacher=teacher, teacher_coef=0.5)
    assert teacher.seen == [1]  # the teacher scores the segment's tokens
    assert out.teacher_logprobs[2].tolist() == pytest.approx([0.0, -0.07, -0.08, 0.0, -0.04])
    # the task's 0.7 (not 0.88, the first token's with its teacher term) plus -0.5 (old - tea) per token
    assert out.advantages[2].tolist() == pytest.approx([0.0, 0.7 + 0.315, 0.7 + 0.36, 0.0, 0.7 + 0.18])


def test_with_per_token_advantages_a_segment_takes_its_trajectorys_first_action_tokens():
    from dataclasses import replace

    segment = row([5, 6, 7, 8, 9, 4], [0, 0, 1, 1, 0, 1])
    trajectories = [row([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], segments=[segment]), row([1, 2, 3, 4], [0, 0, 1, 1])]
    batch = experienced(trajectories, [1.0, 0.0])
    per_token = torch.tensor([[0.0, 0.0, 0.9, 0.3], [0.0, -0.4, -0.6, 0.0]])  # (B, A) a critic's, say
    batch = replace(batch, advantages=per_token, returns=per_token + 1.0 * batch.action_mask)
    out = with_segments(batch, trajectories, pad_token_id=PAD, policy=Logprobs(), reference=Logprobs(), kl_estimator=K1)
    assert out.advantages[2].tolist() == pytest.approx([0.0, 0.9, 0.9, 0.0, 0.9])  # position 2's (token 4), not 3's
    assert out.returns[2].tolist() == pytest.approx([0.0, 1.9, 1.9, 0.0, 1.9])


def test_padding_fills_token_ids_with_the_pad_token_and_the_rest_with_zeros():
    segment = row([5, 6, 7, 8, 9, 4], [0, 0, 1, 1, 0, 1])
    trajectories = [row([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], segments=[segment]), row([1, 2, 3, 4], [0, 0, 1, 1])]
    batch = experienced(trajectories, [1.0, 0.0])
    out = with_segments(batch, trajectories, pad_token_id=9, policy=Logprobs(), reference=Logprobs(), kl_estimator=K1)
    assert out.input_ids[:2, 5].tolist() == [9, 9] and out.attention_mask[:2, 5].tolist() == [0, 0]
    assert out.old_logprobs[:2, 4].tolist() == [0.0, 0.0] and out.action_mask[:2, 4].tolist() == [0.0, 0.0]


def test_a_batch_without_segments_is_unchanged():
    trajectories = [row([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), row([1, 2, 3, 4], [0, 0, 1, 1])]
    batch = experienced(trajectories, [1.0, 0.0])
    assert with_segments(batch, trajectories, pad_token_id=PAD, policy=None) is batch


def test_minibatches_count_trajectories_and_keep_their_rows_together():
    segment = row([5, 6, 7], [0, 1, 1])
    trajectories = [row([1, 2, 3], [0, 1, 1], segments=[segment, segment]), row([1, 2, 3], [0, 1, 1])]
    batch = with_segments(experienced(trajectories, [1.0, 0.0]), trajectories, pad_token_id=PAD,
                          policy=Logprobs(), reference=Logprobs(), kl_estimator=K1)
    assert batch.trajectory_index.tolist() == [0, 1, 0, 0]
    settings = UpdateSettings(train_batch_size=1, micro_batch_size=1, max_new_tokens=4, ppo_epochs=2)
    cuts = minibatches(batch, settings, step=3)
    assert len(cuts) == 4  # 2 trajectories a step, 2 epochs: the segments add no optimizer step
    assert sorted(c.trajectory_index.tolist() for c in cuts) == [[0, 0, 0], [0, 0, 0], [1], [1]]
    whole = minibatches(batch, UpdateSettings(train_batch_size=2, micro_batch_size=1, max_new_tokens=4), step=3)
    assert len(whole) == 1 and sorted(whole[0].trajectory_index.tolist()) == [0, 0, 0, 1]
    # without segments, the same order as ever: a row per trajectory
    plain = experienced(trajectories, [1.0, 0.0])
    generator = torch.Generator().manual_seed(3 * 1_009)
    order = torch.randperm(2, generator=generator)
    assert torch.equal(minibatches(plain, UpdateSettings(train_batch_size=1, micro_batch_size=1, max_new_tokens=4),
                                   step=3)[0].input_ids, plain.select(order[:1]).input_ids)
