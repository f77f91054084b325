"""Escapes reported against the sandbox (issue 19), each contained by an OS mechanism.

As root, with an interpreter whose installation an unprivileged uid cannot reach (a venv in a
0700 directory under /tmp), the sandbox used to keep uid 0 silently: the code read root-only
files, created files in the host's /dev and wrote /proc/sys. ``_posixsubprocess.fork_exec``
went around the audit-hook exec guard; RLIMIT_NPROC did not hold for uid 0 and RLIMIT_AS is per
process. The venv under /tmp was hidden, so its packages could not be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from rlhf.sandbox import run_code

from .conftest import needs_linux

pytestmark = [pytest.mark.unit, needs_linux]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the escapes need the host to run as root")


@pytest.fixture(scope="module")
def closed_venv(tmp_path_factory) -> Path:
    """A venv inside a directory only root can cross (0700), under /tmp, with numpy and one module."""
    parent = Path(tempfile_dir()) / f"rlhf-closed-{uuid.uuid4().hex[:8]}"
    parent.mkdir(mode=0o700)
    venv = parent / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "rlhf_probe_module.py").write_text("ANSWER = 42\n")
    import pluggy  # what importing rlhf needs, for `host_in` below

    (site / "pluggy").symlink_to(Path(pluggy.__file__).parent)
    try:
        import numpy

        package = Path(numpy.__file__).parent
        (site / "numpy").symlink_to(package)
        if (package.parent / "numpy.libs").is_dir():  # its bundled shared libraries (OpenBLAS)
            (site / "numpy.libs").symlink_to(package.parent / "numpy.libs")
    except ImportError:
        pass
    yield venv / "bin" / "python"
    import shutil

    shutil.rmtree(parent, ignore_errors=True)


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


@pytest.fixture
def root_only_file(tmp_path) -> tuple[Path, str]:
    secret = f"secret-{uuid.uuid4().hex}"
    directory = Path("/var/lib") if os.access("/var/lib", os.W_OK) else tmp_path
    path = directory / f"rlhf-root-only-{uuid.uuid4().hex[:8]}"
    path.write_text(secret)
    path.chmod(0o600)
    yield path, secret
    path.unlink()


def _run(code: str, **kwargs):
    kwargs.setdefault("timeout_s", 10)
    return run_code(textwrap.dedent(code), **kwargs)


def host_in(python: Path, code: str, **kwargs) -> dict:
    """`run_code` called by a host process running ``python`` (rlhf itself in a closed venv)."""
    script = (f"import dataclasses, json, sys\nsys.path.insert(0, {str(REPO)!r})\n"
              "from rlhf.sandbox import run_code\n"
              f"r = run_code({textwrap.dedent(code)!r}, **{kwargs!r})\n"
              "print(json.dumps(dataclasses.asdict(r)))\n")
    out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout.splitlines()[-1])


REPO = Path(__file__).resolve().parents[2]


def test_venv_under_tmp_is_importable(closed_venv):
    code = "import rlhf_probe_module\nprint(rlhf_probe_module.ANSWER)\n"
    result = _run(code, python=str(closed_venv))  # the sandbox runs another interpreter
    assert result.status == "ok", result
    assert result.stdout == "42\n"
    hosted = host_in(closed_venv, code, timeout_s=10)  # rlhf itself runs from the venv under /tmp
    assert hosted["status"] == "ok" and hosted["stdout"] == "42\n", hosted


def test_numpy_imports_from_a_venv_under_tmp(closed_venv):
    pytest.importorskip("numpy")
    result = _run("import numpy\nprint(int(numpy.arange(4).sum()))\n", python=str(closed_venv))
    assert result.status == "ok", result
    assert result.stdout == "6\n"


@needs_root
def test_root_drops_to_an_unprivileged_uid_even_with_a_closed_install(closed_venv, root_only_file):
    path, secret = root_only_file
    code = f"""
        import os
        print("uid", os.getuid(), os.geteuid())
        for target in ["{path}", "/etc/shadow"]:
            try:
                print(open(target).read())
            except OSError as exc:
                print("refused", target, type(exc).__name__)
    """
    for result in (host_in(closed_venv, code, timeout_s=10), vars(_run(code, python=str(closed_venv)))):
        assert result["status"] == "ok", result
        assert "uid" in result["isolation"]
        assert "uid 0 " not in result["stdout"] and secret not in result["stdout"]
        with open("/etc/shadow") as f:
            first = f.readline().strip()
        if first:
            assert first not in result["stdout"]


@needs_root
def test_without_namespaces_a_closed_install_is_refused_not_run_as_root(closed_venv):
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("rlhf-sandbox-*"))
    result = host_in(closed_venv, "import os\nprint(os.getuid())\n", namespaces=False)
    assert result["status"] == "sandbox_error", result
    assert "unprivileged uid" in result["message"] and "drop_privileges=False" in result["message"]
    assert set(Path(tempfile.gettempdir()).glob("rlhf-sandbox-*")) <= before, "a working directory was left behind"


@needs_root
@pytest.mark.parametrize("setting", ["closed_install", "kept_root"])
def test_host_dev_and_proc_sys_are_not_writable(closed_venv, setting):
    kwargs = {} if setting == "closed_install" else {"drop_privileges": False}
    name = f"/dev/rlhf-pwned-{uuid.uuid4().hex[:8]}"
    with open("/proc/sys/kernel/domainname") as f:
        domain = f.read()
    code = f"""
        for path, text in [("{name}", "x"), ("/proc/sys/kernel/domainname", "pwned"), ("/proc/sysrq-trigger", "h")]:
            try:
                with open(path, "w") as f:
                    f.write(text)
                print("wrote", path)
            except OSError as exc:
                print("refused", path, type(exc).__name__)
    """
    try:
        result = host_in(closed_venv, code, **kwargs)
        assert result["status"] == "ok", result
        assert not os.path.exists(name), "the code created a file in the host's /dev"
        with open("/proc/sys/kernel/domainname") as f:
            assert f.read() == domain, "the code changed the host's domain name"
        assert "wrote" not in result["stdout"], result["stdout"]
    finally:
        if os.path.exists(name):
            os.unlink(name)
        with open("/proc/sys/kernel/domainname") as f:
            if f.read() != domain:
                with open("/proc/sys/kernel/domainname", "w") as g:
                    g.write(domain)


EXEC_ATTEMPTS = """
    import os, subprocess, types, sys
    # subprocess without its audit event: _posixsubprocess.fork_exec is reached directly
    subprocess.sys = types.SimpleNamespace(audit=lambda *a: None, **{
        k: getattr(sys, k) for k in ("platform", "stdout", "stderr", "flags", "exc_info", "maxsize",
                                     "getfilesystemencoding")})
    try:
        print(subprocess.run(["/bin/sh", "-c", "echo SHELL-RAN"], capture_output=True).stdout)
    except OSError as exc:
        print("refused fork_exec", type(exc).__name__)
    pid = os.fork()
    if pid == 0:
        try:
            os.execv("/bin/sh", ["/bin/sh", "-c", "echo SHELL-RAN"])
        except BaseException as exc:
            print("refused execv", type(exc).__name__)
        os._exit(0)
    os.waitpid(pid, 0)
"""


@pytest.mark.parametrize("mode", [{}, {"namespaces": False, "drop_privileges": False},
                                  {"namespaces": False, "drop_privileges": False, "python_guard": True}])
def test_no_program_can_be_executed(mode):
    result = _run(EXEC_ATTEMPTS, **mode)
    assert "SHELL-RAN" not in result.stdout, result
    assert "seccomp" in result.isolation or "exec" in ",".join(result.isolation)


SOCKET_ATTEMPTS = """
    import ctypes, socket
    libc = ctypes.CDLL(None, use_errno=True)
    for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, 40, 16, 17, 38, 9999):  # 40 AF_VSOCK, 16 netlink,
        try:                                                                               # 17 packet, 38 alg
            socket.socket(family, socket.SOCK_DGRAM if family in (16, 17) else socket.SOCK_STREAM).close()
            print(family, "socket", "opened")
        except OSError as exc:
            print(family, "socket", exc.errno)
        fd = libc.socket(family, socket.SOCK_STREAM, 0)  # the C call, no Python in between
        print(family, "libc", "opened" if fd >= 0 else ctypes.get_errno())
    a, b = socket.socketpair(socket.AF_UNIX)
    print("socketpair AF_UNIX opened")
    pair = (ctypes.c_int * 2)()
    print("socketpair", 40, libc.socketpair(40, socket.SOCK_STREAM, 0, pair), ctypes.get_errno())
"""


@pytest.mark.parametrize("mode", [{}, {"drop_privileges": False}])
def test_only_unix_and_internet_sockets_can_be_opened(mode):
    """AF_VSOCK is not covered by the network namespace (a VM guest reaches its host through it):
    the seccomp filter refuses every socket family but AF_UNIX, AF_INET and AF_INET6."""
    result = _run(SOCKET_ATTEMPTS, seccomp=True, **mode)
    assert result.status == "ok", result
    lines = dict((" ".join(line.split()[:2]), line.split()[-1]) for line in result.stdout.splitlines())
    for family in (1, 2, 10):
        assert lines[f"{family} socket"] == "opened" and lines[f"{family} libc"] == "opened", result.stdout
    for family in (40, 16, 17, 38, 9999):
        for how in ("socket", "libc"):
            assert lines[f"{family} {how}"] in ("97", "1"), (family, how, result.stdout)  # EAFNOSUPPORT or EPERM
    assert "socketpair AF_UNIX opened" in result.stdout
    assert lines["socketpair 40"] in ("97", "1"), result.stdout


@pytest.mark.parametrize("mode", [{}, {"drop_privileges": False}, {"namespaces": False, "drop_privileges": False}])
def test_process_limit_covers_the_whole_tree(mode):
    code = """
        import os, threading, time
        n = 0
        for i in range(300):
            try:
                if os.fork() == 0:
                    time.sleep(2)
                    os._exit(0)
                n += 1
            except (OSError, PermissionError):  # PermissionError: the guard, where no OS limit exists
                break
        print("children", n)
        threading.stack_size(1 << 16)  # small stacks: the address-space limit is not what stops them
        n = 0
        for i in range(300):  # threads count too, and no audit hook sees them
            try:
                threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
                n += 1
            except RuntimeError:
                break
        print("threads", n)
    """
    result = _run(code, max_processes=32, **mode)
    assert result.status == "ok", result
    counts = dict(line.split() for line in result.stdout.splitlines())
    assert int(counts["children"]) <= 32 and int(counts["threads"]) <= 32, result.stdout


@pytest.mark.parametrize("cgroup", [None, False])
def test_memory_limit_covers_the_whole_tree(cgroup):
    code = """
        import os, time
        pids = []
        for i in range(3):
            pid = os.fork()
            if pid == 0:
                block = bytearray(300 * 2 ** 20)
                for j in range(0, len(block), 4096):
                    block[j] = 1
                time.sleep(1)
                os._exit(0)
            pids.append(pid)
        print("statuses", [os.waitpid(p, 0)[1] for p in pids])
    """
    from rlhf.sandbox import _sandbox_cgroup

    if cgroup is None and _sandbox_cgroup.discover()["memory"] is None:
        pytest.skip("no writable memory cgroup here (the case cgroup=False covers the fallback)")
    result = _run(code, memory_mb=512, timeout_s=30, cgroup=cgroup)
    assert ("cgroup_memory" if cgroup is None else "memory_watchdog") in result.isolation
    assert result.status == "killed", result
    assert "memory limit (512 MiB for all the code's processes together)" in result.message
    assert "statuses [0, 0, 0]" not in result.stdout


def test_isolation_reports_the_layers():
    result = _run("print(1)")
    layers = set(result.isolation)
    assert "rlimits" in layers
    if os.geteuid() == 0:
        assert "uid" in layers
    if "mount_ns" in layers:
        assert {"readonly_fs", "minimal_dev", "proc_sys_ro", "masked_etc"} <= layers


def test_a_missing_layer_is_warned_about_once():
    import warnings

    import rlhf.sandbox._sandbox_host as host
    import rlhf.sandbox as sandbox

    host._warned.clear()
    start = {"isolation": ["pid_ns", "net_ns", "mount_ns", "readonly_fs", "minimal_dev", "proc_sys_ro", "uid",
                           "cgroup_memory", "cgroup_pids"], "notes": ["seccomp unavailable: not filtered"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            host._warn_missing_layers(start, sandbox.SandboxConfig())
        host._warn_missing_layers(start, sandbox.SandboxConfig(seccomp=False))  # turned off: no warning
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "not available on this machine: seccomp" in messages[0], messages


GUARD_ONLY = {"namespaces": False, "drop_privileges": False, "python_guard": True}


def test_the_guard_cannot_be_turned_off_through_a_traceback(tmp_path):
    """Where the audit-hook guard is the only file protection, its state used to be reachable from
    a refusal's traceback (f_locals): clearing its rules let the code write anywhere."""
    target = Path("/etc" if os.geteuid() == 0 else str(tmp_path)) / f"rlhf-pwned-{uuid.uuid4().hex[:8]}"
    code = f"""
        try:
            open("{target}", "w")
        except BaseException as exc:
            tb = exc.__traceback__
            while tb is not None:
                for value in list(tb.tb_frame.f_locals.values()):
                    if type(value).__name__ == "_local":
                        value.busy = True
                    if isinstance(value, set):
                        value.clear()
                tb = tb.tb_next
        try:
            open("{target}", "w").write("x")
            print("wrote")
        except OSError as exc:
            print("refused", type(exc).__name__)
    """
    try:
        result = _run(code, **GUARD_ONLY)
        assert result.status == "ok", result
        assert "refused PermissionError" in result.stdout and not target.exists()
    finally:
        if target.exists():
            target.unlink()


@pytest.mark.parametrize("attempt", [
    "import sqlite3\nc = sqlite3.connect(':memory:')\nc.execute(\"ATTACH '{target}' AS x\")\nc.execute('create table x.t(a)')",
    "import ctypes\nctypes.CDLL(None).creat(b'{target}', 0o644)",
])
def test_the_guard_covers_native_writers(tmp_path, attempt):
    target = Path("/etc" if os.geteuid() == 0 else str(tmp_path)) / f"rlhf-pwned-{uuid.uuid4().hex[:8]}"
    try:
        result = _run(attempt.format(target=target), namespaces=False, drop_privileges=False)  # the guard by default
        assert result.status == "error" and "sandbox:" in result.stderr, result
        assert not target.exists()
    finally:
        if target.exists():
            target.unlink()
