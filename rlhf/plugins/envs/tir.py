"""Tool-integrated reasoning (TIR): the model writes ```python blocks, the sandbox runs them.

After ToRA (Gou et al., 2023, arXiv:2309.17452) and the TIR loop of the OpenRLHF fork
(``yyht/openrlhf_async_pipline``, ``math_tir_generate_async``). One episode::

    turn:  ...reasoning...\\n```python\\nprint(6 * 7)\\n```\\n      <- generation stops here ("```\\n")
    env:   ```output\\n42\\n```\\n                                  <- observation, loss mask 0
    turn:  ...so the answer is \\boxed{42}.                          <- no code block: done

* Stop string: ``"```\\n"`` (a fence followed by a newline). It ends a turn right after the
  closing fence of a code block, never at an opening ````python`` fence (a letter follows
  those). The env only reads ``action_text``: a turn is a tool call when it ends with a closed
  ```python (or ```py / ```python3) block, ignoring trailing whitespace and the rest of the
  token that completed the stop string (at most one partial line).
* A turn that stopped on a fence that is not the end of a python block (e.g. the opening of a
  plain ``` block) continues: empty observation, same stop string, at most
  ``max_continuations`` times.
* Any other turn is the final answer: ``done``. Reward 0 from the env: the answer is scored by
  the reward sources. The ``max_tool_calls``-th call is run and the next turn generates without
  the stop string; a further code block then ends the episode (``info["end"] ==
  "max_tool_calls"``).
* The output block holds stdout, then stderr (the traceback, or only its last line with
  ``show_traceback=False``), a line for a timeout or a kill, cut to ``max_output_chars`` with a
  ``[... N characters truncated ...]`` marker between head and tail.

Deviations from the fork: one stop string instead of switching between ````python`` and fence
stops (one generation call per code block, not two); outputs are truncated by characters, not
replaced by a fixed message over 256 tokens; ``persist_state`` replays earlier successful cells
silently (the fork's ``MULTITURN_CODE_MERGE``), with the remote sandbox by concatenation (so
traceback line numbers include the replayed cells).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from rlhf.api import RlhfError, StepResult
from rlhf.sandbox import SandboxConfig, SandboxResult, run_code_async

FENCE_STOP = "```\n"
STOP = [FENCE_STOP]
_CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\n(?P<code>(?:.*?\n)?)```", re.DOTALL)
_SPILL_CHARS = 16  # what may follow the closing fence: the tail of the token that matched the stop


class TIRConfigError(RlhfError):
    """A TIR setting that cannot work."""


@dataclass(kw_only=True)
class TIRConfig:
    """Settings of the ``tir`` environment (one instance shared by every trajectory of a run)."""

    timeout_s: float = field(default=5.0, metadata={"help": "wall-clock limit per code block, seconds",
                                                         "range": "(0, inf)"})
    memory_mb: int = field(default=1024, metadata={"help": "address-space limit per code block, MiB",
                                                          "range": "[1, inf)"})
    max_output_chars: int = field(default=1024, metadata={"help": "characters of output shown to the model",
                                                                 "range": "[1, inf)"})
    max_tool_calls: int = field(default=4, metadata={"help": "code blocks run per episode",
                                                             "range": "[1, inf)"})
    max_continuations: int = field(default=4, metadata={"help": "turns that stopped on a non-python fence",
                                                                "range": "[0, inf)"})
    persist_state: bool = field(default=False, metadata={"help": "replay earlier successful cells before each one"})
    show_traceback: bool = field(default=True, metadata={"help": "full traceback (else only its last line)"})
    sandbox_url: str | None = field(default=None, metadata={"help": "SandboxFusion-style server instead of local"})
    sandbox_options: dict[str, Any] = field(default_factory=dict,
                                            metadata={"help": "more SandboxConfig fields, e.g. {'max_processes': 8}"})

    def __post_init__(self) -> None:
        known = {f.name for f in fields(SandboxConfig)}
        unknown = set(self.sandbox_options) - known
        if unknown:
            raise TIRConfigError(f"unknown sandbox option(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
        for name in ("timeout_s", "memory_mb", "max_output_chars", "max_tool_calls"):
            if not getattr(self, name) > 0:
                raise TIRConfigError(f"tir: {name} must be > 0, got {getattr(self, name)!r}")


def extract_tool_call(action_text: str) -> str | None:
    """The code of the python block that ends ``action_text``, or None when it is not a tool call."""
    last = None
    for last in _CODE_BLOCK.finditer(action_text):
        pass
    if last is None:
        return None
    tail = action_text[last.end():]
    spill = tail.strip() == "" or (tail[:1] == "\n" and "\n" not in tail[1:] and "`" not in tail
                                   and len(tail) <= _SPILL_CHARS)
    return last.group("code") if spill else None


def truncate_middle(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters (head and tail kept) with a marker where it was cut."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]}\n[... {len(text) - limit} characters truncated ...]\n{text[len(text) - (limit - head):]}"


def render_output(result: SandboxResult, config: TIRConfig) -> str:
    """What the model sees of one execution (the inside of the ```output block)."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stdout_truncated:
        parts.append("[... output truncated ...]")
    stderr = result.stderr.strip()
    if stderr and not config.show_traceback and result.status == "error":
        stderr = stderr.splitlines()[-1]
    if stderr:
        parts.append(stderr)
    if result.status == "timeout":
        parts.append(f"TimeoutError: the code ran longer than {config.timeout_s:g} s and was stopped")
    elif result.status == "killed":
        parts.append(f"Killed: {result.message}")
    elif result.status == "sandbox_error":
        parts.append(f"SandboxError: {result.message}")
    return truncate_middle("\n".join(parts), config.max_output_chars)


class TIREnv:
    """Tool-integrated reasoning: ```python blocks run in a sandbox; output returns as ```output."""

    stop = STOP
    sample_prompt = "What is 6 times 7? Use Python."
    sample_label = "42"
    sample_actions = ["Let me compute it.\n```python\nprint(6 * 7)\n```\n", "The answer is \\boxed{42}."]

    def __init__(self, config: TIRConfig | None = None):
        self.config = config or TIRConfig()
        self.tool_calls = self.tool_errors = self.continuations = 0
        self.cells: list[str] = []  # code that ran without error, replayed when persist_state

    def reset(self, prompt: Any, label: Any, **columns: Any) -> None:
        self.tool_calls = self.tool_errors = self.continuations = 0
        self.cells = []
        return None

    async def step(self, action_text: str) -> StepResult:
        cfg = self.config
        code = extract_tool_call(action_text)
        if code is None:
            if action_text.endswith(FENCE_STOP) and self.continuations < cfg.max_continuations:
                self.continuations += 1
                return StepResult(stop=STOP, info={"continued": True})
            return StepResult(done=True, info=self.summary("answer"))
        if self.tool_calls >= cfg.max_tool_calls:
            return StepResult(done=True, info=self.summary("max_tool_calls"))
        self.tool_calls += 1
        result = await self.execute(code)
        if result.ok:
            self.cells.append(code)
        else:
            self.tool_errors += 1
        newline = "" if action_text.endswith("\n") else "\n"
        observation = f"{newline}```output\n{render_output(result, cfg)}\n```\n"
        more = self.tool_calls < cfg.max_tool_calls
        return StepResult(observation=observation, stop=STOP if more else None,
                          info={"tool_calls": self.tool_calls, "sandbox_status": result.status,
                                "sandbox_s": result.duration_s})

    async def execute(self, code: str) -> SandboxResult:
        cfg = self.config
        prelude = "\n".join(self.cells) if cfg.persist_state else ""
        memory_mb = cfg.sandbox_options.get("memory_mb", cfg.memory_mb)
        if cfg.sandbox_url:
            from rlhf.sandbox.remote import RemoteSandbox

            if prelude:
                code = _silenced(prelude) + code
            remote = RemoteSandbox(url=cfg.sandbox_url, max_output_bytes=self.output_bytes())
            return await remote.run_code_async(code, timeout_s=cfg.timeout_s, memory_mb=memory_mb)
        options = {"timeout_s": cfg.timeout_s, "memory_mb": memory_mb, "max_output_bytes": self.output_bytes(),
                   **cfg.sandbox_options}
        return await run_code_async(code, prelude=prelude, **options)

    def output_bytes(self) -> int:
        return max(1 << 16, 8 * self.config.max_output_chars)  # room for the tail of long outputs

    def summary(self, end: str) -> dict[str, Any]:
        return {"end": end, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors}


def _silenced(prelude: str) -> str:
    """``prelude`` as source that runs it with output and errors discarded (for a remote sandbox)."""
    return ("import contextlib as _rlhf_c, io as _rlhf_io\n"
            "try:\n"
            "    with _rlhf_c.redirect_stdout(_rlhf_io.StringIO()), _rlhf_c.redirect_stderr(_rlhf_io.StringIO()):\n"
            f"        exec(compile({prelude!r}, '<prelude>', 'exec'), globals())\n"
            "except BaseException:\n"
            "    pass\n")
