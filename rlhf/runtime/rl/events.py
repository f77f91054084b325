"""What an RL run tells its plugins and its user during a step: the lifecycle events of batch
making and eval (``on_rollout_end``, ``on_rewards``, ``on_eval``; rlhf/core/plugin_host/hookspecs.py)
and warnings.

Under a launcher every rank runs the loop and the main rank alone speaks: the other ranks' calls
do nothing, as in the lifecycle's own emitter (rlhf/runtime/run/lifecycle.py). Plugins see one
call at a time: with ``--async`` the producer's threads fire events too.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from rlhf.core.distributed import DistContext
from rlhf.core.plugin_host.loading import PluginSet
from rlhf.core.types import RunInfo

log = logging.getLogger(__name__)


class Events:
    def __init__(self, plugins: PluginSet, dist: DistContext):
        self.plugins, self.speaks = plugins, dist.is_main
        self.run: RunInfo | None = None  # the run's, set once it starts
        self.lock = threading.RLock()

    def emit(self, event: str, **kwargs: Any) -> None:
        """``event`` to every plugin that implements it, with the run's `RunInfo` as ``run``."""
        if self.speaks:
            with self.lock:
                self.plugins.emit(event, run=self.run, **kwargs)

    def warn(self, message: str, *args: Any) -> None:
        if self.speaks:
            log.warning(message, *args)
