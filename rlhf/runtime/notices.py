"""The notices libraries print in every normal run that ask nothing of the user, hidden unless
``rlhf -v`` (or ``RLHF_DEBUG=1``) asks for them.

* DeepSpeed: "Setting accelerator to CPU. If you have GPU ..." (a warning, whenever transformers
  imports DeepSpeed on a machine without a GPU) and "Setting ds_accelerator to cpu (...)" (at info,
  where DeepSpeed's logger is turned up).
* Ray: "Token authentication is enabled for this Ray cluster ..." when a run starts its own local
  cluster (Ray's secure default, not a problem to solve; the warning that authentication is
  *disabled* stays).

A filter on each library's logger drops them, set before the library loads (nothing is imported
here). Ray's workers are other processes: the driver passes ``RLHF_QUIET_NOTICES=1`` in their
environment when it is quiet itself (`worker_environment`), and each worker installs the same
filters before it builds anything, so a worker's DeepSpeed line does not reach the terminal
through Ray's log forwarding either.
"""

from __future__ import annotations

import logging
import os

# (logger, message start): the logger is the one the library logs on (a filter on a logger sees only its
# own records, not those its children propagate).
LIBRARY_NOTICES = (
    ("DeepSpeed", "Setting accelerator to CPU"),
    ("DeepSpeed", "Setting ds_accelerator to "),
    ("ray._private.authentication.authentication_token_setup", "Token authentication is enabled for this Ray cluster"),
)
QUIET_ENV = "RLHF_QUIET_NOTICES"


class _DropNotices(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_library_notices() -> None:
    """Install the filters in this process (idempotent)."""
    for name in {logger for logger, _ in LIBRARY_NOTICES}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotices) for f in logger.filters):
            logger.addFilter(_DropNotices(tuple(start for n, start in LIBRARY_NOTICES if n == name)))


def notices_are_quiet() -> bool:
    """Whether this process hides the notices (`quiet_library_notices` ran)."""
    return any(isinstance(f, _DropNotices) for f in logging.getLogger(LIBRARY_NOTICES[0][0]).filters)


def worker_environment() -> dict[str, str]:
    """What a worker process's environment needs to be as quiet as this process."""
    return {QUIET_ENV: "1"} if notices_are_quiet() else {}


def quiet_if_asked() -> None:
    """In a worker process: hide the notices when the driver said so (`worker_environment`)."""
    if os.environ.get(QUIET_ENV, "") not in ("", "0"):
        quiet_library_notices()
