"""The fit loop's data: rows encoded once into examples by the objective, and optimizer steps
over them in a resumable order.

Rows are encoded when the run starts (so the run's length is known and every skipped row is
reported before training): a row the objective skips (`SkipExample`) is counted per reason and
reported once with the first such row; a bad row (`BadRow`) stops the run naming its file and row.

`StepOrder` hands out optimizer steps: each epoch is a fresh shuffle drawn from (seed, epoch),
and only full steps are taken (the last ``len % batch_size`` examples of a shuffle wait for the
next epoch's), so step ``k`` holds the same examples whether or not the run was resumed, on
every rank. Rank r takes the step's examples r, r + W, ...
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rlhf.core.protocols.objective import BadRow, Objective, SkipExample, TextFormat
from rlhf.runtime.run.data import DataError, row_origin, row_values

log = logging.getLogger(__name__)


def encode_rows(dataset: Any, objective: Objective, text: TextFormat, *, what: str = "--data") -> list[Any]:
    """Every row of ``dataset`` (from `rlhf.runtime.run.data.load_rows`) as an example of ``objective``."""
    examples: list[Any] = []
    skipped: Counter[str] = Counter()
    first: dict[str, str] = {}
    for index in range(len(dataset)):
        row = dataset[index]
        try:
            examples.append(objective.encode(row_values(row), text))
        except SkipExample as reason:
            skipped[str(reason)] += 1
            first.setdefault(str(reason), row_origin(row))
        except BadRow as exc:
            raise DataError(f"{row_origin(row)}: {exc}") from None
    for reason, count in skipped.items():
        log.warning("%s: %s; skipped (%d row%s of %s in all)", first[reason], reason, count,
                    "" if count == 1 else "s", what)
    if not examples:
        raise DataError(f"{what}: no usable rows ({sum(skipped.values())} skipped)")
    return examples


@dataclass(frozen=True)
class StepOrder:
    """Which examples make up each optimizer step."""

    num_examples: int
    batch_size: int
    seed: int = 42

    def __post_init__(self) -> None:
        if self.num_examples < self.batch_size:
            raise DataError(f"the training data has {self.num_examples} usable examples, fewer than --batch-size "
                            f"{self.batch_size}; lower --batch-size")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int) -> list[int]:
        """The examples of optimizer step ``step`` (0-based, counted over all epochs)."""
        epoch, position = divmod(step, self.steps_per_epoch)
        order = _epoch_order(self.num_examples, self.seed, epoch)
        return order[position * self.batch_size:(position + 1) * self.batch_size]


@functools.lru_cache(maxsize=2)
def _epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_examples, generator=generator).tolist()
