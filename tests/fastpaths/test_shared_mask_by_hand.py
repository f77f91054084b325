"""The prefix-sharing attention mask written out by hand (rlhf/fastpaths/prefix_sharing.py) for a
layout with a group of three rows (one of them no longer than the shared prefix), a row alone and
a group with a one-token prefix, rows padded on either side: the mask `share_prefixes` builds,
the 4D masks the model gets (boolean for sdpa, additive for eager), and attention per segment
(rlhf/fastpaths/segment_attention.py) against dense attention under the hand-written mask."""

from __future__ import annotations

import pytest
import torch

from rlhf.fastpaths.prefix_sharing import attention_mask_4d, share_prefixes
from rlhf.fastpaths.segment_attention import segment_attention, segment_layout

pytestmark = pytest.mark.unit

t, f = True, False

ROWS = [[1, 2, 3, 4, 5],  # group 0: prefix 1 2 3, then 4 5
        [1, 2, 3, 6],     # group 0: then 6 (left-padded below)
        [1, 2, 3],        # group 0: the prefix itself, nothing after it
        [7, 8],           # group 1: alone, the whole row is its prefix
        [9, 10, 11],      # group 2: prefix 9, then 10 11
        [9, 12]]          # group 2: then 12 (left-padded below)
GROUPS = [[0, 1, 2], [3], [4, 5]]

# slot by slot: (G, L, L) query (row) attends key (column)
ALLOWED = [
    [[t, f, f, f, f, f],   # 1       the prefix, causally
     [t, t, f, f, f, f],   # 2
     [t, t, t, f, f, f],   # 3
     [t, t, t, t, f, f],   # 4       row 0: the prefix and itself
     [t, t, t, t, t, f],   # 5
     [t, t, t, f, f, t]],  # 6       row 1: the prefix and itself, not row 0's 4 5
    [[t, f, f, f, f, f],   # 7
     [t, t, f, f, f, f],   # 8
     [f, f, t, f, f, f],   # padding: itself only
     [f, f, f, t, f, f],
     [f, f, f, f, t, f],
     [f, f, f, f, f, t]],
    [[t, f, f, f, f, f],   # 9
     [t, t, f, f, f, f],   # 10      row 4
     [t, t, t, f, f, f],   # 11
     [t, f, f, t, f, f],   # 12      row 5: the prefix and itself, not row 4's 10 11
     [f, f, f, f, t, f],   # padding
     [f, f, f, f, f, t]],
]


def padded_rows():
    width = 6
    ids = torch.zeros(len(ROWS), width, dtype=torch.long)
    mask = torch.zeros(len(ROWS), width, dtype=torch.long)
    for r, row in enumerate(ROWS):
        start = width - len(row) if r % 2 else 0  # odd rows left-padded, even rows right-padded
        ids[r, start:start + len(row)] = torch.tensor(row)
        mask[r, start:start + len(row)] = 1
    return ids, mask


def test_the_layout_and_its_mask_are_the_hand_written_ones():
    ids, mask = padded_rows()
    rows = share_prefixes(ids, mask, GROUPS)
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 0, 0, 0, 0], [9, 10, 11, 12, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 0, 0, 0, 0], [0, 1, 2, 1, 0, 0]]
    assert rows.segments.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, -1, -1, -1, -1], [0, 1, 1, 2, -1, -1]]
    assert rows.index.tolist() == [[0, 1, 2, 3, 4, -1], [-1, -1, 0, 1, 2, 5], [0, 1, 2, -1, -1, -1],
                                   [-1, -1, -1, -1, 6, 7], [12, 13, 14, -1, -1, -1], [-1, -1, -1, -1, 12, 15]]
    assert rows.allowed.tolist() == ALLOWED


def test_each_row_sees_exactly_its_own_earlier_tokens():
    """The hand-written mask, read back through the index: the slots of row r's tokens i and j
    (j <= i) are connected, and no slot of another row's remainder is."""
    ids, mask = padded_rows()
    rows = share_prefixes(ids, mask, GROUPS)
    allowed = torch.tensor(ALLOWED)
    length = allowed.shape[1]
    for r in range(len(ROWS)):
        slots = rows.index[r][rows.index[r] >= 0].tolist()
        group = slots[0] // length
        seen = {(a % length, b % length) for i, a in enumerate(slots) for b in slots[:i + 1]}
        for a in slots:
            for b in range(length):
                if b in {s % length for s in slots}:
                    expected = (a % length, b) in seen
                    assert bool(allowed[group, a % length, b]) == expected, (r, a, b)


def test_the_4d_masks_the_model_gets():
    ids, mask = padded_rows()
    rows = share_prefixes(ids, mask, GROUPS)
    allowed = torch.tensor(ALLOWED)

    class Inner(torch.nn.Module):
        def __init__(self, implementation):
            super().__init__()
            self.config = type("Config", (), {"_attn_implementation": implementation})()
            self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float16))

    sdpa = attention_mask_4d(Inner("sdpa"), rows.allowed)
    assert sdpa.dtype == torch.bool and sdpa.tolist() == allowed[:, None].tolist()
    eager = attention_mask_4d(Inner("eager"), rows.allowed)
    minimum = torch.finfo(torch.float16).min
    assert eager.dtype == torch.float16 and eager.shape == (3, 1, 6, 6)
    assert torch.equal(eager, torch.where(allowed, 0.0, minimum).to(torch.float16)[:, None])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_per_segment_is_dense_attention_under_the_hand_written_mask(kv_heads):
    ids, mask = padded_rows()
    rows = share_prefixes(ids, mask, GROUPS)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 6, 8, generator=generator, requires_grad=True)  # (G, H, L, D)
    key = torch.randn(3, kv_heads, 6, 8, generator=generator, requires_grad=True)  # (G, K, L, D)
    value = torch.randn(3, kv_heads, 6, 8, generator=generator, requires_grad=True)
    real = rows.segments >= 0  # (G, L)
    upstream = torch.randn(3, 6, 4, 8, generator=generator) * real[:, :, None, None]  # (G, L, H, D)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=torch.tensor(ALLOWED)[:, None], scale=0.4,
        enable_gqa=kv_heads != 4).transpose(1, 2)  # (G, L, H, D)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
    got = segment_attention(query, key, value, segment_layout(rows.segments), 0.4)
    got_grads = torch.autograd.grad((got * upstream).sum(), (query, key, value))
    assert torch.allclose(got[real], expected[real], atol=1e-5)
    assert (got[~real] == 0).all()
    for name, a, b in zip("qkv", got_grads, expected_grads):
        assert float(b.abs().max()) > 0.1, name
        assert torch.allclose(a, b, atol=1e-5), name
