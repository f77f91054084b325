"""The settings and the result of one sandboxed execution; public as
``rlhf.sandbox.SandboxConfig`` and ``SandboxResult`` (see that module for the layers)."""

from __future__ import annotations

from dataclasses import dataclass, field

STATUSES = ("ok", "error", "timeout", "killed", "sandbox_error")


@dataclass(kw_only=True, frozen=True)
class SandboxConfig:
    """Limits and isolation settings of one execution."""

    timeout_s: float = field(default=10.0, metadata={"help": "wall-clock limit in seconds, from when the code starts"})
    memory_mb: int = field(default=1024, metadata={"help": "address-space limit (RLIMIT_AS) in MiB"})
    cpu_time_s: int | None = field(default=None, metadata={"help": "CPU seconds per process; default ceil(timeout_s) + 1"})
    max_processes: int = field(default=32, metadata={"help": "processes and threads (RLIMIT_NPROC), where enforceable"})
    max_file_size_mb: int = field(default=16, metadata={"help": "largest file the code may write (RLIMIT_FSIZE), MiB"})
    max_open_files: int = field(default=256, metadata={"help": "open file descriptors (RLIMIT_NOFILE)"})
    disk_mb: int = field(default=64, metadata={"help": "size of the private /tmp and working directory (tmpfs), MiB"})
    max_output_bytes: int = field(default=1 << 20, metadata={"help": "bytes kept per stream (stdout, stderr)"})
    env: dict[str, str] | None = field(default=None, metadata={"help": "extra environment variables for the code"})
    python: str | None = field(default=None, metadata={"help": "interpreter to run the code; default sys.executable"})
    site_packages: bool = field(default=True, metadata={"help": "put the interpreter's site-packages on sys.path"})
    namespaces: bool | None = field(default=None, metadata={"help": "pid/net/mount/ipc namespaces: None when possible"})
    drop_privileges: bool | None = field(default=None, metadata={"help": "as root, run as an unprivileged uid"})
    python_guard: bool | None = field(default=None, metadata={"help": "audit-hook guard; None: where OS layers are missing"})
    seccomp: bool | None = field(default=None, metadata={"help": "seccomp filter (no exec, no namespaces): None when possible"})
    cgroup: bool | None = field(default=None, metadata={"help": "memory and process limits on the whole tree: None when possible"})
    hide_paths: tuple[str, ...] = field(default=(), metadata={"help": "more files and directories to hide (with namespaces)"})
    hide_defaults: bool = field(default=True, metadata={"help": "hide the paths registered with hide_by_default (a run's "
                                                                "data, run directory, reward sources, project)"})

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_processes", "max_file_size_mb", "max_open_files", "disk_mb",
                     "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(kw_only=True)
class SandboxResult:
    """What one execution did. ``message`` explains any status but ``ok`` in one line."""

    status: str  # one of STATUSES
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None  # exit code of the code's process; None when it did not exit
    signal: int | None = None  # the signal that killed it
    duration_s: float = 0.0  # wall clock of the whole call, start-up included
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    message: str = ""
    cpu_s: float | None = None
    isolation: tuple[str, ...] = ()  # layers enforced, see the module docstring

    @property
    def ok(self) -> bool:
        return self.status == "ok"
