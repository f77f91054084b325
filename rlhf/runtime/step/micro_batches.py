"""How a step's batch is cut, the same for both loops: shuffled minibatches per epoch (RL), and
micro-batches of items of similar length, ``size`` items or as many as fit a token budget
(`cut_by_length`: the RL loop's rows, the fit loop's examples), a prompt's samples together when
they share its forward (RL).

Shape legend: ``B`` sequences, ``T`` tokens.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from rlhf.core.batch import ExperienceBatch
from rlhf.core.distributed import DistContext
from rlhf.fastpaths.prefix_sharing import common_prefix



@dataclass(kw_only=True)
class UpdateSettings:
    """How one rollout batch turns into optimizer steps (shared by policy and critic)."""

    ppo_epochs: int = 1
    train_batch_size: int  # samples per optimizer step
    micro_batch_size: int  # samples per forward/backward
    max_tokens_per_micro_batch: int | None = None  # cut micro-batches by tokens instead (`micro_batches`)
    packing: bool = False  # forwards run packed (rlhf/fastpaths/packing.py)
    share_prompt: bool = False  # a prompt's samples share its forward when that pays (`shared_micro_batches`)
    max_new_tokens: int  # Dr. GRPO's constant normaliser
    seed: int = 0


def minibatches(batch: ExperienceBatch, settings: UpdateSettings, step: int) -> list[ExperienceBatch]:
    """Shuffled minibatches for every epoch, with a per-(seed, step, epoch) order (resumable):
    ``batch``'s rows `minibatch_rows` gives."""
    return [batch.select(rows) for rows in minibatch_rows(batch, settings, step)]


def minibatch_rows(batch: ExperienceBatch, settings: UpdateSettings, step: int) -> list[torch.Tensor]:
    """The rows of each minibatch of every epoch in ``batch``, (b,) each, shuffled per (seed, step,
    epoch). ``train_batch_size`` counts trajectories: a trajectory's segment rows
    (``trajectory_index``, `rlhf.runtime.step.segments`) go into its minibatch, after the
    trajectories' own rows."""
    out = []
    owners = batch.trajectory_index  # (B,) or None: a row per trajectory
    count = batch.size if owners is None else int(owners.max()) + 1
    for epoch in range(settings.ppo_epochs):
        generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step * 1_009 + epoch)
        order = torch.randperm(count, generator=generator)
        for begin in range(0, count, settings.train_batch_size):
            rows = order[begin:begin + settings.train_batch_size]  # the trajectories' own rows
            if owners is not None:
                segments = torch.arange(count, batch.size)  # (E,)
                rows = torch.cat([rows, segments[torch.isin(owners[count:], rows)]])
            out.append(rows)
    return out


def cut_by_length(lengths: list[int], size: int, max_tokens: int | None = None, *, rows: list[int] | None = None,
                  tokens: list[int] | None = None, packed: bool = False) -> list[list[int]]:
    """The micro-batches of both loops, as lists of item indices: items sorted by length (stably)
    and cut every ``size`` items, or with ``max_tokens`` into as many as fit that many tokens
    (`token_budget_groups`). Sorting before cutting removes most padding (benchmarks/packing.py
    measures it on mixed lengths), and losses are sums over items, so the order changes nothing but
    float rounding.

    ``lengths[i]``: the longest sequence of item i (an RL row is one sequence; a fit example may be
    several, ``rows[i]``, e.g. a preference pair); ``tokens[i]``: its real tokens, what it costs
    when ``packed`` (default ``lengths``)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if max_tokens is None:
        return [order[begin:begin + size] for begin in range(0, len(order), size)]
    cost = [(tokens if tokens is not None else lengths)[i] if packed else lengths[i] for i in order]
    groups = token_budget_groups(cost, max_tokens, rows=None if rows is None else [rows[i] for i in order],
                                 packed=packed)
    return [[order[i] for i in group] for group in groups]


def micro_batches(minibatch: ExperienceBatch, size: int, max_tokens: int | None = None,
                  packed: bool = False) -> list[tuple[torch.Tensor, ExperienceBatch]]:
    """``(rows, micro-batch)`` pairs of RL rows of similar length (`cut_by_length`; a row's real
    tokens are its length)."""
    lengths = minibatch.attention_mask.sum(dim=1).tolist()  # (b,)
    cuts = [torch.tensor(cut, dtype=torch.long) for cut in cut_by_length(lengths, size, max_tokens, packed=packed)]
    return [(rows, minibatch.select(rows)) for rows in cuts]


# A prompt's samples share its forward when that needs at most this share of the padded tokens:
# below it the saving outweighs the mask's cost (benchmarks/README.md, prefix sharing).
SHARE_AT_MOST = 0.9


@dataclass(frozen=True)
class MicroBatch:
    rows: torch.Tensor  # (b,) the micro-batch's rows in the batch it was cut from
    batch: ExperienceBatch
    groups: list[list[int]] | None = None  # rows of one prompt, to share its forward; None: run unshared
    # in an update (one process): its rows in the step's batch, when no optimizer step of the step has
    # run before it (the forward is the policy's before the update); else None
    before_update: torch.Tensor | None = None


def shared_micro_batches(minibatch: ExperienceBatch, size: int) -> list[MicroBatch] | None:
    """``size`` rows each, a prompt's samples (``group_index``) together, each micro-batch with its
    groups of rows that share the prompt's forward (`rlhf.fastpaths.prefix_sharing`); None when that
    would not save a tenth of the tokens of length-sorted padded micro-batches (`micro_batches`)."""
    lengths = minibatch.attention_mask.sum(dim=1)  # (b,)
    by_length = torch.argsort(lengths, stable=True)  # (b,)
    padded = sum(len(cut) * int(lengths[cut].max()) for cut in by_length.split(size))
    group_count = int(minibatch.group_index.max()) + 1
    group_length = lengths.new_zeros(group_count).scatter_reduce(0, minibatch.group_index, lengths, "amax")  # (groups,)
    key = group_length[minibatch.group_index] * group_count + minibatch.group_index  # (b,)
    order = torch.argsort(key * (lengths.max() + 1) + lengths, stable=True)  # (b,) groups of similar length together
    planned, shared = [], 0
    for rows in order.split(size):
        micro = minibatch.select(rows)
        members: dict[int, list[int]] = defaultdict(list)
        for row, group in enumerate(micro.group_index.tolist()):
            members[group].append(row)
        groups = list(members.values())
        real = micro.attention_mask.bool()  # (b', T)
        tokens = [micro.input_ids[row][real[row]].tolist() for row in range(micro.size)]
        row_length = [sum(len(tokens[r]) for r in group) - (len(group) - 1) * common_prefix([tokens[r] for r in group])
                      for group in groups]
        shared += len(groups) * max(row_length)
        planned.append(MicroBatch(rows, micro, groups))
    return planned if shared <= SHARE_AT_MOST * padded else None


def my_rows(batch: ExperienceBatch, dist: DistContext) -> ExperienceBatch:
    """This rank's rows of a batch every rank holds (rows rank, rank + W, ...)."""
    return batch if not dist.active else batch.select(dist.shard(list(range(batch.size))))


def plan_micro_batches(minibatch: ExperienceBatch, size: int, max_tokens: int | None = None, packed: bool = False,
                       share: bool = False) -> list[MicroBatch]:
    """`shared_micro_batches` when ``share`` allows it (not with token budgets or packing) and
    pays, else `micro_batches`."""
    if share and max_tokens is None and not packed:
        shared = shared_micro_batches(minibatch, size)
        if shared is not None:
            return shared
    return [MicroBatch(rows, micro) for rows, micro in micro_batches(minibatch, size, max_tokens, packed)]


def token_budget_groups(lengths: list[int], max_tokens: int, *, rows: list[int] | None = None,
                        packed: bool = False) -> list[list[int]]:
    """Consecutive groups of items (in the given order) of at most ``max_tokens`` tokens each; an
    item over the budget alone. An item is ``rows[i]`` sequences (default 1) of at most ``lengths[i]``
    tokens, or ``lengths[i]`` tokens in all when ``packed`` (its real tokens). Padded, a group costs
    its rows x its longest sequence; packed, the sum of its tokens."""
    rows = rows if rows is not None else [1] * len(lengths)
    groups: list[list[int]] = []
    current: list[int] = []
    total = longest = count = 0
    for item, (length, n_rows) in enumerate(zip(lengths, rows)):
        if packed:
            cost = total + length
        else:
            cost = (count + n_rows) * max(longest, length)
        if current and cost > max_tokens:
            groups.append(current)
            current, total, longest, count = [], 0, 0, 0
        current.append(item)
        total, longest, count = total + length, max(longest, length), count + n_rows
    if current:
        groups.append(current)
    return groups
