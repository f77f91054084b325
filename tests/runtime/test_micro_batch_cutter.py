"""The one micro-batch cutter of both loops (`cut_by_length`), by hand."""

from __future__ import annotations

import pytest
import torch

from rlhf.runtime.step.micro_batches import cut_by_length, micro_batches
from rlhf.core.batch import collate
from rlhf.core.types import Trajectory

pytestmark = pytest.mark.unit


def test_items_are_sorted_by_length_stably_then_cut_every_size_items():
    assert cut_by_length([5, 2, 5, 1, 2], 2) == [[3, 1], [4, 0], [2]]


def test_a_token_budget_pays_rows_times_the_longest_when_padded():
    # sorted: 3 (len 2), 0 (3), 1 (4), 2 (6); two rows each: 4 rows x 3 = 12 fits, 6 x 4 = 24 does not,
    # then 2 x 4 = 8 and 4 x 6 = 24
    assert cut_by_length([3, 4, 6, 2], 1, 12, rows=[2, 2, 2, 2]) == [[3, 0], [1], [2]]
    assert cut_by_length([3, 4, 6, 2], 1, 11, rows=[2, 2, 2, 2]) == [[3], [0], [1], [2]]


def test_a_token_budget_pays_the_real_tokens_when_packed():
    # sorted by length: 1 (len 2, 2 tokens), 0 (len 4, 3 tokens), 2 (len 5, 5 tokens)
    assert cut_by_length([4, 2, 5], 1, 5, tokens=[3, 2, 5], packed=True) == [[1, 0], [2]]
    assert cut_by_length([4, 2, 5], 1, 5, tokens=[3, 2, 5], packed=False) == [[1], [0], [2]]


def test_an_item_over_the_budget_goes_alone():
    assert cut_by_length([9, 1], 4, 4) == [[1], [0]]


def test_the_rl_rows_are_the_cutters_groups():
    lengths = [4, 2, 6, 2, 3]
    trajectories = [Trajectory(token_ids=[5] + [7] * (n - 1), loss_mask=[0] + [1] * (n - 1), prompt_length=1,
                               prompt="p", prompt_text="p", completion_text="c", group=i)
                    for i, n in enumerate(lengths)]
    batch = collate(trajectories, pad_token_id=0, rewards=torch.zeros(5), sample_mask=torch.ones(5))
    for size, budget in ((2, None), (3, None), (1, 8)):
        got = [rows.tolist() for rows, _ in micro_batches(batch, size, budget)]
        assert got == cut_by_length(lengths, size, budget)
        for rows, micro in micro_batches(batch, size, budget):
            width = micro.input_ids.shape[1]
            assert torch.equal(micro.input_ids, batch.input_ids[rows][:, :width])
            assert int(batch.attention_mask[rows][:, width:].sum()) == 0  # only padding cut off


def test_shared_micro_batches_keep_each_prompts_rows_together():
    """Rows of one prompt go to one micro-batch (their prompt's forward is shared), groups ordered by
    their longest row: prompt 0's rows (10 and 20 tokens) straddle prompt 1's (14 and 15), so cutting
    by row length alone would split both prompts and share nothing."""
    from rlhf.runtime.step.micro_batches import shared_micro_batches

    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    answers = [(0, 2), (1, 6), (0, 12), (1, 7)]  # (prompt, answer length)
    trajectories = [Trajectory(token_ids=prompt + [3] * n, loss_mask=[0] * len(prompt) + [1] * n,
                               prompt_length=len(prompt), prompt="p", prompt_text="p", completion_text="c", group=g)
                    for g, n in answers]
    batch = collate(trajectories, pad_token_id=0, rewards=torch.zeros(4), sample_mask=torch.ones(4))
    batch.group_index = torch.tensor([g for g, _ in answers])
    planned = shared_micro_batches(batch, 2)
    assert planned is not None
    assert [micro.rows.tolist() for micro in planned] == [[1, 3], [0, 2]]
    assert all(len(micro.groups) == 1 and sorted(micro.groups[0]) == [0, 1] for micro in planned)
