"""Run untrusted Python in a separate, contained process: ``run_code(code) -> SandboxResult``.

Standalone: standard library only (with its ``_sandbox_*.py`` modules: the host side of one
execution, the supervisor it starts and the code's process, mounts, seccomp, cgroups; the
supervisor imports its siblings as top-level modules inside the untrusted process, hence names
no program's own modules take), usable without the rest of rlhf; ``rlhf.sandbox.remote`` is a
client of a sandbox server with the same results::

    from rlhf.sandbox import run_code
    result = run_code("print(6 * 7)", timeout_s=2)
    result.status, result.stdout        # ("ok", "42\\n")

``run_code`` never raises for anything the code does: an exception, ``sys.exit``, a timeout, a
crash or a limit becomes ``status`` ``"ok" | "error" | "timeout" | "killed" | "sandbox_error"``
with ``stdout``/``stderr`` (capped while reading, with ``*_truncated`` flags), ``returncode``,
``duration_s`` and ``isolation``: the layers actually enforced for this call. One call costs one
Python start-up (``python -I -S``) plus a fork.

Every call: a new process in its own session with a scrubbed environment (PATH, locale,
one-thread BLAS settings and ``env=``; nothing inherited), a fresh empty working directory (also
HOME and TMPDIR), rlimits on address space, CPU seconds, file size, open files and core dumps, a
wall-clock timeout counted from when the code starts, output caps (a stream over 8x its cap
kills the program), no capabilities, ``no_new_privs``, a parent-death signal (if rlhf dies, so
does the sandbox), and clean-up of every process the code started, double-forked daemons
included. Then the strongest of these layers the OS allows (``namespaces``, ``drop_privileges``,
``seccomp``, ``cgroup``, ``python_guard``: ``None`` = when possible, ``True`` = required,
``False`` = off). A layer this machine cannot provide is named in a ``RuntimeWarning``, once:

================  ============================================================================
layer             effect (where)
================  ============================================================================
``pid_ns``        own pid namespace: the code sees and can signal only its own processes; when
                  its main process ends, the kernel kills the rest (root with CAP_SYS_ADMIN, or
                  any user where unprivileged user namespaces are allowed)
``net_ns``        own network namespace, no interface up: no network at all, loopback included
``mount_ns``      private ``/tmp`` (also ``/var/tmp``, ``/dev/shm``, ``/run/lock``): a tmpfs of
                  ``disk_mb`` holding the working directory, gone with the namespace
``readonly_fs``   every other mount read-only, ``/sys`` included (per mount: the host's stay
                  writable)
``proc``          a fresh ``/proc`` listing only the sandbox's processes
``proc_sys_ro``   ``/proc/sys``, ``/proc/sysrq-trigger`` and the other kernel knobs read-only
``minimal_dev``   ``/dev`` is a read-only tmpfs with only null, zero, full, random, urandom
``masked_etc``    ``/etc/shadow``, ``/etc/gshadow``, sudoers and ssh host keys read as empty
``masked_dirs``   home directories of the user running rlhf and any directory an unprivileged
                  uid could not cross on the way to Python replaced by empty tmpfs; the Python
                  installation (a venv too, even under ``/tmp``) stays visible, read-only; of an
                  editable install (a ``.pth`` path line: hatchling, pdm, flit, setuptools'
                  compat and strict modes; or an import hook: setuptools' finder, ``editables``,
                  meson-python, scikit-build-core, its literal mapping read, never run; meson's
                  install plan read as data) only what it imports (packages, modules, extension
                  modules, metadata): its project folder is emptied around them, so its data,
                  reward files and run folders do not exist inside. A hook not understood, or
                  one whose paths are computed when it runs, hides its project whole (the one
                  its text names or pip recorded for it: ``editable_hook_not_understood:PATH``
                  beside ``hidden:PATH``)
``hidden:PATH``   one per hidden path, checked from inside on every call before it is listed:
                  ``hide_paths`` and, unless ``hide_defaults=False``, what ``hide_by_default``
                  registered (a training run registers its data, eval data, run directory,
                  reward sources, the project it runs in and the datasets cache). A hidden path
                  does not exist inside (a read fails with ENOENT) and no mount names it, so
                  ``/proc/self/mountinfo`` does not say where to look; exceptions: a hidden
                  folder holding the Python installation or an editable install's packages
                  stays as an empty folder with those bound back (its name is in ``sys.path``
                  anyway); one right under ``/`` or in a folder of over 512 entries is covered
                  by an unreadable empty one
``uid``           as root: the code always runs as a fresh unprivileged uid (random per call),
                  so file permissions protect the host and RLIMIT_NPROC applies. Without mount
                  namespaces, an installation that uid cannot reach is an error
                  (``sandbox_error``), never a silent uid 0: pass ``drop_privileges=False`` to
                  run as root on purpose
``user_ns``       not root: a user namespace instead (same uid, no capabilities)
``nproc``         RLIMIT_NPROC (``max_processes``) in force (never for uid 0)
``seccomp``       a seccomp filter: ``execve``/``execveat`` (no program ever starts, whatever
                  the path: ``subprocess``, ``_posixsubprocess``, ctypes), namespaces,
                  ``ptrace``, mounts, ``bpf``, ``io_uring``, keyrings, modules, clocks... fail
                  with EPERM; sockets of any family but ``AF_UNIX``, ``AF_INET`` and
                  ``AF_INET6`` (``AF_VSOCK``, netlink, packet...) fail with EAFNOSUPPORT
                  (x86_64 and aarch64)
``cgroup_memory`` a cgroup per call (root, v2 or v1): ``memory_mb`` (+64 MiB for the
                  supervisors) of resident memory for all the code's processes together; going
                  over is ``killed`` with a message naming the limit
``cgroup_pids``   the same cgroup: ``max_processes`` tasks (threads included) for the whole tree
``memory_watchdog`` without a memory cgroup: the supervisor sums the tree's memory (PSS) every
                  50 ms and kills it over ``memory_mb`` (a poll: it can overshoot for one tick)
``guard:RULES``   best effort, by default only for what an OS layer above does not cover: a
                  PEP 578 audit hook refusing network calls (``network``), writes outside the
                  working directory (``files``), signals to and /proc reads of other processes
                  (``procs``), forks (``fork``), and starting programs or calling C through
                  ctypes (``exec``). Native code can get around it: it stops accidents and
                  naive attempts, not a determined attacker.
================  ============================================================================

Typical set-ups: root in a VM or a privileged container gets every layer; a normal user with
user namespaces gets all but ``uid`` and the cgroups; a Docker container without CAP_SYS_ADMIN
gets ``uid`` and ``nproc`` (when the interpreter is readable by other users), ``seccomp`` plus
the guard; elsewhere, rlimits, clean-up through a child subreaper, and the guard. If setting up
namespaces fails after ``unshare`` (e.g. AppArmor-restricted user namespaces), the call is
retried without them and later calls skip them. Never enforced: world-readable host files stay
readable (masked directories excepted), unix sockets on the filesystem stay reachable where file
permissions allow, and site-packages' ``.pth`` files are not run (``site_packages=True`` puts
the directories and the ``.pth`` files' path lines on ``sys.path`` and adds a finder for the
import hooks understood: editable installs import, but for hooks not understood; meson-python's
and scikit-build-core's rebuild on import does not run inside). ``memory_mb`` is
also the per-process address-space limit, so one process over it gets a ``MemoryError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._sandbox_execution import (  # noqa: F401 - constants re-exported for callers and tests
    BASE_ENV, OUTPUT_KILL_FACTOR, SANDBOX_UIDS, _Execution, hidden_by_default, hide_by_default,
)
from ._sandbox_types import STATUSES, SandboxConfig, SandboxResult  # noqa: F401 - the public types

__all__ = ["SandboxConfig", "SandboxResult", "hidden_by_default", "hide_by_default", "run_code", "run_code_async",
           "set_max_concurrency"]

_NO_NAMESPACES: set[str] = set()  # interpreters whose namespace set-up failed here: not retried


def run_code(code: str, *, stdin: str | bytes = "", prelude: str = "", config: SandboxConfig | None = None,
             **overrides: Any) -> SandboxResult:
    """Run ``code`` (Python source) in a new sandboxed process and wait for it.

    ``overrides`` are `SandboxConfig` fields (``timeout_s=2``, ``memory_mb=256``, ...) applied on
    top of ``config``. ``stdin`` is what the code reads from standard input. ``prelude`` runs
    first in the same namespace with its output and errors discarded (a notebook-like
    environment replays earlier cells this way); the timeout covers both.
    """
    if not isinstance(code, str) or not isinstance(prelude, str):
        raise TypeError(f"code and prelude must be str, got {type(code).__name__} and {type(prelude).__name__}")
    config = dataclasses.replace(config or SandboxConfig(), **overrides)
    python = config.python or sys.executable
    if config.namespaces is None and python in _NO_NAMESPACES:
        config = dataclasses.replace(config, namespaces=False)
    started = time.monotonic()
    try:
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        execution = _Execution(code, stdin_bytes, prelude, config)
        result = execution.run()
        if config.namespaces is None and (execution.event("error") or {}).get("stage") == "namespaces":
            _NO_NAMESPACES.add(python)  # e.g. user namespaces that grant no capabilities (AppArmor)
            return run_code(code, stdin=stdin, prelude=prelude, config=dataclasses.replace(config, namespaces=False))
        return result
    except Exception as exc:  # our failure (or the OS's), never the code's doing
        return SandboxResult(status="sandbox_error", message=f"{type(exc).__name__}: {exc}",
                             duration_s=time.monotonic() - started)


# --- async: a bounded pool, so many trajectories run code without blocking the event loop ------

_executor_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_max_concurrency = int(os.environ.get("RLHF_SANDBOX_MAX_CONCURRENCY", "0")) or max(4, os.cpu_count() or 1)


def set_max_concurrency(n: int) -> None:
    """How many executions ``run_code_async`` runs at once in this process (default: CPU count,
    at least 4; or ``RLHF_SANDBOX_MAX_CONCURRENCY``). Calls over the bound wait their turn."""
    global _executor, _max_concurrency
    if n < 1:
        raise ValueError(f"max concurrency must be >= 1, got {n}")
    with _executor_lock:
        _max_concurrency = n
        if _executor is not None:
            _executor.shutdown(wait=False)
            _executor = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=_max_concurrency, thread_name_prefix="rlhf-sandbox")
        return _executor


async def run_code_async(code: str, *, stdin: str | bytes = "", prelude: str = "",
                         config: SandboxConfig | None = None, **overrides: Any) -> SandboxResult:
    """`run_code` on a bounded thread pool; awaiting it never blocks the event loop."""
    call = functools.partial(run_code, code, stdin=stdin, prelude=prelude, config=config, **overrides)
    return await asyncio.get_running_loop().run_in_executor(_pool(), call)
