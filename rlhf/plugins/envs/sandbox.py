"""The sandbox moved to its own package, `rlhf.sandbox`; this name keeps code written against it working
(``python -m rlhf.plugins.envs.sandbox 'print(1)'`` too)."""

from rlhf.sandbox import *  # noqa: F401,F403
from rlhf.sandbox import OUTPUT_KILL_FACTOR, SANDBOX_UIDS, STATUSES  # noqa: F401

if __name__ == "__main__":
    import runpy

    runpy.run_module("rlhf.sandbox", run_name="__main__")
