"""The sandbox moved to its own package, `rlhf.sandbox`; this name keeps code written against it working."""

from rlhf.sandbox import *  # noqa: F401,F403
from rlhf.sandbox import OUTPUT_KILL_FACTOR, SANDBOX_UIDS, STATUSES  # noqa: F401
