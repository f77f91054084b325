"""The viewer's one page: ``static/page.html`` with its stylesheet, its script and the data it starts
from put inline, for the server (data: which runs, the session's token) and for ``--export``
(data: every chosen step's samples). Everything the page needs is in the package: it loads
nothing from the network.

The data goes into a ``<script type="application/json">`` block, so text from samples must not end
it: `script_json` writes ``<``, ``>`` and ``&`` as JSON escapes (``\\u003c``...), which a
``</script>`` or ``<!--`` inside a sample cannot survive, and ``JSON.parse`` reads back as they
were. The page itself puts sample text into the document only as text (``textContent``), never
as markup.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

STATIC = Path(__file__).resolve().parent / "static"


def plain(data: Any) -> Any:
    """``data`` with every float that is not finite as None (JSON has no NaN; a log may hold one)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {str(k): plain(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [plain(v) for v in data]
    return data


def to_json(data: Any, *, ascii_only: bool = False) -> str:
    try:
        return json.dumps(data, ensure_ascii=ascii_only, allow_nan=False, default=str)
    except ValueError:  # a NaN somewhere
        return json.dumps(plain(data), ensure_ascii=ascii_only, allow_nan=False, default=str)


def script_json(data: Any) -> str:
    """``data`` as JSON that is safe inside a ``<script>`` element (no ``<``, ``>`` or ``&`` left)."""
    text = to_json(data, ascii_only=True)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _asset(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def render(boot: dict[str, Any], *, nonce: str | None = None) -> str:
    """The page's HTML. ``nonce``: the server's per-response CSP nonce (None: the export's own policy
    in a meta tag, which allows inline code and nothing from anywhere)."""
    attr = f' nonce="{nonce}"' if nonce else ""
    policy = ("" if nonce else
              '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
              "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:\">")
    parts = {"POLICY": policy, "STYLE": f"<style{attr}>{_asset('viewer.css')}</style>",
             "BOOT": f'<script type="application/json" id="boot"{attr}>{script_json(boot)}</script>',
             "SCRIPT": f"<script{attr}>{_asset('viewer.js')}</script>"}
    # one pass over the template: text put in is never searched again
    return re.sub(r"\{\{(POLICY|STYLE|BOOT|SCRIPT)\}\}", lambda match: parts[match.group(1)], _asset("page.html"))
