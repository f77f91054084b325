"""The README's worked third-party model adapter, ``examples/plugins/rlhf-freeze``, importable by the
tests without installing it: this module is its plugin module (the tests register it directly)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "plugins" / "rlhf-freeze"))

from rlhf_freeze.adapter import FreezeAdapter, FreezeConfig  # noqa: E402
from rlhf_freeze.plugin import register_models  # noqa: E402

__all__ = ["FreezeAdapter", "FreezeConfig", "register_models"]
