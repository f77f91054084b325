"""The remote sandbox client moved to `rlhf.sandbox.remote`; this name keeps code written against it working."""

from rlhf.sandbox.remote import *  # noqa: F401,F403
from rlhf.sandbox.remote import RemoteSandbox  # noqa: F401
