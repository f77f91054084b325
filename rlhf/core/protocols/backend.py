"""The training-backend contract (``register_train_backends``): one model's optimizer steps.

The runtime creates ``backend_cls(model, config)`` for each trained model (policy, critic) and,
per optimizer step, calls ``backward(loss)`` once per micro-batch (each loss is already that
micro-batch's share of the step loss, so gradients add up) and then ``step()`` (clip; step
unless the gradient is NaN/inf; clear gradients either way), or ``zero_grad()`` to drop the step.
Under data parallelism every rank holds a backend and the backend combines the ranks' gradients
so that the step gradient is their **sum** (each rank's losses are its share of the step loss).

Capabilities, declared by the implementation (class attributes or properties):

* ``shards_weights``: the parameters are partitioned over ranks (DeepSpeed ZeRO-3). Every forward
  is then a collective, so ranks generate in lockstep, and whole weights exist only inside
  ``full_weights()``, which every rank must enter (export, weight sync).
* ``shards_state``: model and optimizer state are partitioned over ranks (DeepSpeed at every
  stage): every rank calls ``save_checkpoint(directory)`` / ``load_checkpoint(directory)``.
  Otherwise the state is replicated and the main rank saves the model's ``state_dict()`` and the
  backend's ``state_dict()`` (optimizer, schedule).

Registered with ``offloads_state=True``, a backend also has ``offload_state(params)`` and
``reload_state()`` (``--offload-train-state``): the first moves the optimizer state and any
gradients off the device, and the parameters too when ``params`` is true and the backend shards
them (the engine then has weights of its own), returning the bytes moved (0 when unknown); the
second brings everything back exactly. The runtime calls them around generation only.

Optionally, ``accumulating()``: a context the runtime enters around each optimizer step's forwards
and backwards; a backend that adds nothing to a gradient as autograd hands it over (the ``torch``
one) lets the vocabulary-sized gradients go straight into ``.grad`` there
(``rlhf.fastpaths.in_place_gradients``). The default (and a backend without it) lets nothing.

`TrainBackendBase` gives the defaults of a backend that shards nothing; subclass it and override
what differs. A class registered as a backend is checked against `TrainBackend` on registration
(or on first use when registered by ``"module:attr"`` reference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlhf.core.errors import PluginError

if TYPE_CHECKING:
    import torch


@runtime_checkable
class TrainBackend(Protocol):
    shards_weights: bool
    shards_state: bool

    @property
    def train_module(self) -> torch.nn.Module:
        """What training forwards call (the model, or a wrapper that hooks the backward that follows)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of one micro-batch's share of the step loss."""

    def step(self) -> dict[str, float]:
        """Finish the optimizer step: ``{"grad_norm" (before clipping), "lr" (used), "skipped" (1.0 when
        a non-finite gradient made it a no-op, else 0.0)}``. Gradients are cleared either way."""

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step (the step is skipped)."""

    def state_dict(self) -> dict[str, Any]:
        """Replicated backend state (optimizer, LR schedule) for checkpoints."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_checkpoint(self, directory: Path) -> None:
        """``shards_state`` only: write this rank's share of model and optimizer state (every rank calls it)."""

    def load_checkpoint(self, directory: Path) -> None: ...

    def full_weights(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the model holds its whole weights (every rank enters it)."""


class TrainBackendBase:
    """Defaults for a backend whose weights and state are whole on every rank."""

    shards_weights = False
    shards_state = False

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @property
    def train_module(self) -> torch.nn.Module:
        return self.model

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[None]:
        yield

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """Entered around each optimizer step's forwards and backwards: a backend that adds nothing to
        a gradient as autograd hands it over may let its weights take vocabulary-sized gradients
        into ``.grad`` meanwhile (`rlhf.fastpaths.in_place_gradients`). Default: nothing."""
        return contextlib.nullcontext()

    def save_checkpoint(self, directory: Path) -> None:
        raise PluginError(self._not_sharded("save_checkpoint"))

    def load_checkpoint(self, directory: Path) -> None:
        raise PluginError(self._not_sharded("load_checkpoint"))

    def _not_sharded(self, method: str) -> str:
        return (f"{type(self).__qualname__} shards no state, so the runtime saves state_dict() and never calls "
                f"{method}; a backend that sets shards_state must override save_checkpoint and load_checkpoint")


def sharded_but_not_saved(backend_cls: type) -> str | None:
    """A backend class that declares ``shards_state`` must write its own checkpoints."""
    from rlhf.core.plugin_host.contracts import declared

    if declared(backend_cls, "shards_state", False) is True and backend_cls.save_checkpoint is TrainBackendBase.save_checkpoint:
        return "a backend that overrides save_checkpoint and load_checkpoint (it declares shards_state)"
    return None
