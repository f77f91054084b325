"""Write docs/plugin-hooks.md from the hook specs' docstrings (the contract lives in one place).

Run ``python docs/generate_hook_docs.py`` after changing rlhf/core/plugin_host/hookspecs.py; a test fails
when the file is stale.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

HEADER = """# Plugin hooks

Generated from `rlhf/core/plugin_host/hookspecs.py` by `python docs/generate_hook_docs.py`; do not edit by hand.

A plugin implements any of these with `@rlhf.hookimpl`, declaring only the arguments it uses
(without default values: pluggy never passes an argument that has a default).

"""


def render() -> str:
    from rlhf.core.plugin_host import hookspecs

    module_doc = inspect.getdoc(hookspecs) or ""
    parts = [HEADER, "## How hooks work\n\n", module_doc.split("\n", 1)[1].strip(), "\n"]
    sections = {"register_": "## Registration hooks\n", "on_": "## Lifecycle hooks\n"}
    for prefix, title in sections.items():
        parts.append("\n" + title)
        for name, obj in vars(hookspecs).items():
            if hasattr(obj, "rlhf_spec") and name.startswith(prefix):
                args = ", ".join(inspect.signature(obj).parameters)
                parts.append(f"\n### `{name}({args})`\n\n{inspect.getdoc(obj)}\n")
    return "".join(parts)


if __name__ == "__main__":
    target = Path(__file__).with_name("plugin-hooks.md")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    target.write_text(render())
    print(f"wrote {target}")
