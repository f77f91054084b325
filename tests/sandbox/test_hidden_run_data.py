"""Sandboxed code cannot read the run's data: a training run registers its data, eval data, run
directory, reward sources, project and datasets cache with `rlhf.sandbox.hide_by_default`; every
call hides them (a read fails: they do not exist inside), checks from inside that they are gone,
and lists those in ``result.isolation``."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from rlhf import sandbox
from rlhf.sandbox import SandboxConfig, run_code

PRINT_FILE = "import sys\ntry:\n    print(repr(open(sys.argv[1] if len(sys.argv) > 1 else {path!r}).read()))\n" \
             "except OSError as exc:\n    print('refused', exc.errno)\n"


def _namespaces_here() -> bool:
    return "mount_ns" in run_code("pass", timeout_s=10).isolation


needs_namespaces = pytest.mark.skipif(not _namespaces_here(), reason="no mount namespace here: nothing can be hidden")


@pytest.mark.unit
@needs_namespaces
def test_model_code_cannot_print_a_label_from_the_data_file(project, registered):
    code = PRINT_FILE.format(path=str(project["elsewhere"]))
    before = run_code(code, timeout_s=10)
    assert project["answer"] in before.stdout  # without hiding, the file is readable (root's sandbox uid too)
    hidden = registered([project["elsewhere"], project["root"]])
    assert hidden == tuple(sorted((str(project["elsewhere"]), str(project["root"]))))
    result = run_code(code, timeout_s=10)
    assert result.status == "ok", result
    assert project["answer"] not in result.stdout and result.stdout == "refused 2\n"  # ENOENT: a read fails
    assert f"hidden:{project['elsewhere']}" in result.isolation
    assert f"hidden:{project['root']}" in result.isolation
    inside = run_code(PRINT_FILE.format(path=str(project["data"])), timeout_s=10)  # under a hidden directory
    assert project["answer"] not in inside.stdout
    listing = run_code(f"import os\ntry:\n    print(os.listdir({str(project['root'])!r}))\n"
                       "except OSError as exc:\n    print('refused', exc.errno)", timeout_s=10)
    assert listing.stdout == "refused 2\n"  # the hidden folder does not exist inside
    opted_out = run_code(code, config=SandboxConfig(timeout_s=10, hide_defaults=False))
    assert project["answer"] in opted_out.stdout and not any(x.startswith("hidden:") for x in opted_out.isolation)


@pytest.mark.unit
@needs_namespaces
def test_hide_paths_hides_a_single_file_too(project):
    result = run_code(PRINT_FILE.format(path=str(project["elsewhere"])),
                      config=SandboxConfig(timeout_s=10, hide_paths=(str(project["elsewhere"]),)))
    assert result.stdout == "refused 2\n" and f"hidden:{project['elsewhere']}" in result.isolation


@pytest.mark.run
def test_a_training_run_registers_its_data_run_directory_rewards_and_project(tiny_model_dir, task, tmp_path, plugins,
                                                                           monkeypatch, registered):
    from tests.helpers import run_cli

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    seen = []
    real = sandbox.hide_by_default
    monkeypatch.setattr(sandbox, "hide_by_default", lambda paths: seen.append(real(paths)) or seen[-1])
    out = tmp_path / "run"
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--eval-data", str(task / "data.jsonl"), "--label-key", "answer", "--reward",
                               f"{task / 'rewards.py'}:reward_func@0.5", "--n-samples", "2", "--prompts-per-step", "2",
                               "--max-new-tokens", "2", "--steps", "1", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert seen and set(seen[-1]) == {str((task / "data.jsonl").resolve()), str((task / "rewards.py").resolve()),
                                      str(out.resolve()), str(project.resolve())}


@pytest.mark.unit
def test_system_directories_are_never_registered_as_the_project(tmp_path):
    from types import SimpleNamespace

    from rlhf.runtime.run.lifecycle import run_data_paths

    config = SimpleNamespace(data=[], eval_data=[], reward=["exact_match"], env="single_turn")
    assert run_data_paths(config, tmp_path / "run", cwd=Path("/")) == [str((tmp_path / "run").resolve())]
    assert run_data_paths(config, tmp_path / "run", cwd=Path("/tmp")) == [str((tmp_path / "run").resolve())]




@pytest.mark.unit
@needs_namespaces
def test_hidden_paths_under_tmp_are_hidden_by_the_private_tmp(tmp_path, registered):
    """Data under /tmp (a test's, a scratch run's): nothing to mount over, the code still runs, and the
    path is reported hidden (the sandbox's /tmp is its own)."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"answer": "42"}\n')
    registered([data, tmp_path])
    result = run_code("print(6 * 7)", timeout_s=10)
    assert result.status == "ok" and result.stdout == "42\n", result
    assert f"hidden:{data}" in result.isolation and f"hidden:{tmp_path}" in result.isolation


# --- the probe's reproductions (issue 55): editable installs and the datasets cache, as root ----------

READ_ALL = """import json
out = {}
for path in json.loads(PATHS):
    try:
        with open(path, "rb") as f:
            out[path] = f.read().decode("latin-1")
    except OSError as exc:
        out[path] = exc.errno
mounts = open("/proc/self/mountinfo").read()
print(json.dumps({"reads": out, "mountinfo": mounts}))
"""


def _read_all(paths, **config):
    result = run_code(f"PATHS = {json.dumps([str(p) for p in paths])!r}\n" + READ_ALL, timeout_s=20, **config)
    assert result.status == "ok", result
    return json.loads(result.stdout), result


@pytest.fixture
def editable(project):
    """``project`` installed in editable mode the way hatchling, pdm, flit and setuptools' compat
    mode do it: a venv whose site-packages holds a ``.pth`` file naming the project's folder."""
    import subprocess
    import sys

    root = project["root"]
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (root / "rewards.py").write_text(f"ANSWER = {project['answer']!r}\n")
    (root / "runs" / "exp").mkdir(parents=True)
    (root / "runs" / "exp" / "samples.jsonl").write_text(json.dumps({"label": project["answer"]}) + "\n")
    venv = root.parent / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_dir = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                              capture_output=True, text=True).stdout.strip()
    (Path(site_dir) / "_project.pth").write_text(f"{root}\n")
    import pluggy  # what importing rlhf needs, when rlhf itself runs from this venv

    (Path(site_dir) / "pluggy").symlink_to(Path(pluggy.__file__).parent)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return {**project, "python": str(python), "rewards": root / "rewards.py",
            "samples": root / "runs" / "exp" / "samples.jsonl"}


def _in_venv(editable, hidden, code):
    """`run_code` called by rlhf running from the venv with the editable install (its own interpreter)."""
    import subprocess

    script = (f"import dataclasses, json, sys\nsys.path.insert(0, {str(REPO)!r})\nfrom rlhf import sandbox\n"
              f"sandbox.hide_by_default({[str(h) for h in hidden]!r})\n"
              f"r = sandbox.run_code({code!r}, timeout_s=20)\nprint(json.dumps(dataclasses.asdict(r)))\n")
    out = subprocess.run([editable["python"], "-c", script], capture_output=True, text=True, check=True, timeout=120)
    return sandbox.SandboxResult(**json.loads(out.stdout.splitlines()[-1]))


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.unit
@needs_namespaces
@pytest.mark.parametrize("host", ["rlhf-in-venv", "code-in-venv"])
@pytest.mark.parametrize("project_hidden", [False, True], ids=["run-elsewhere", "run-in-project"])
def test_an_editable_install_shows_its_packages_and_nothing_else(editable, registered, project_hidden, host):
    secrets = [editable["data"], editable["rewards"], editable["samples"]]
    hidden = [editable["data"], editable["rewards"], *([editable["root"]] if project_hidden else [])]
    read_all = f"PATHS = {json.dumps([str(p) for p in secrets])!r}\n" + READ_ALL
    importing = "import pkg, os\nprint(pkg.VALUE, sorted(os.listdir(os.path.dirname(pkg.__path__[0]))))"
    if host == "rlhf-in-venv":
        result, imported = (_in_venv(editable, hidden, code) for code in (read_all, importing))
    else:
        registered(hidden)
        result, imported = (run_code(code, timeout_s=20, python=editable["python"]) for code in (read_all, importing))
    assert result.status == "ok", result
    seen = json.loads(result.stdout)
    assert editable["answer"] not in json.dumps(seen["reads"])
    assert all(errno in (2, 13) for errno in seen["reads"].values()), seen["reads"]  # a read fails
    for path in (editable["data"], editable["data"].parent, editable["rewards"], editable["samples"].parent):
        assert str(path) not in seen["mountinfo"], path  # the mount table does not say where to look
    for path in hidden:
        assert f"hidden:{path}" in result.isolation
    assert imported.stdout == "42 ['pkg']\n", imported  # importable, and the only thing there


@pytest.mark.unit
@needs_namespaces
def test_the_datasets_cache_of_a_run_is_hidden(project, registered, monkeypatch):
    """HF_HOME outside home and /tmp (/data/hf on a cluster): `datasets` keeps an arrow copy of
    --data under $HF_HOME/datasets; the run registers that folder, so model code cannot read it."""
    from types import SimpleNamespace

    import datasets.config

    from rlhf.runtime.run.data import load_one
    from rlhf.runtime.run.lifecycle import hide_run_data

    hf_home = project["root"].parent / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_home / "datasets")
    (hf_home / "hub").mkdir(parents=True)
    hf_home.chmod(0o755)
    assert load_one(str(project["data"]), "train")[0]["answer"] == project["answer"]
    arrows = sorted((hf_home / "datasets").rglob("*.arrow"))
    assert arrows and any(project["answer"].encode() in a.read_bytes() for a in arrows)
    for path in (hf_home / "datasets").rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # world-readable: the sandbox uid could read it
    before, _ = _read_all(arrows, hide_defaults=False)
    assert project["answer"] in json.dumps(before["reads"])
    monkeypatch.chdir("/")
    config = SimpleNamespace(data=[str(project["data"])], eval_data=[], reward=[], env=None)
    assert str(hf_home / "datasets") in hide_run_data(config, project["root"].parent / "run")
    seen, result = _read_all(arrows)
    assert project["answer"] not in json.dumps(seen["reads"]) and set(seen["reads"].values()) == {2}
    assert str(hf_home / "datasets") not in seen["mountinfo"]
    assert f"hidden:{hf_home / 'datasets'}" in result.isolation and f"hidden:{project['data']}" in result.isolation
    listing = run_code(f"import os\nprint(sorted(os.listdir({str(hf_home)!r})))", timeout_s=20)
    assert listing.stdout == "['hub']\n", listing  # the rest of HF_HOME stays as it was


@pytest.mark.unit
@needs_namespaces
def test_the_mount_table_does_not_name_hidden_paths(project, registered):
    registered([project["elsewhere"], project["root"]])
    seen, result = _read_all([project["elsewhere"], project["data"]])
    assert set(seen["reads"].values()) == {2}
    assert str(project["elsewhere"]) not in seen["mountinfo"] and str(project["root"]) not in seen["mountinfo"]


@pytest.mark.unit
@needs_namespaces
def test_a_path_that_stays_readable_is_not_listed_as_hidden():
    """The Python installation is never hidden: asked to hide it, the call still imports from it,
    and ``isolation`` does not claim it is hidden (each listed path is checked from inside). A
    folder inside it can be hidden, and then is."""
    import json as json_module  # a package of the installation

    from rlhf.sandbox._sandbox_host import _python_layout

    installation = tuple(_python_layout()["python_paths"])
    result = run_code("import json\nprint(json.dumps(1))", timeout_s=20, hide_paths=installation)
    assert result.status == "ok" and result.stdout == "1\n", result
    assert not any(f"hidden:{path}" in result.isolation for path in installation)
    package = str(Path(json_module.__file__).resolve().parent)
    result = run_code("import json", timeout_s=20, hide_paths=(package,))
    assert result.status == "error" and f"hidden:{package}" in result.isolation


@pytest.mark.unit
@needs_namespaces
@pytest.mark.parametrize("where", ["a folder of 600 entries", "right under /"])
def test_hidden_paths_whose_folder_cannot_be_rebuilt_are_unreadable(project, registered, where):
    """No mount per entry of a huge folder, and no rebuilding /: the hidden path keeps its name
    but cannot be read (as the sandbox uid, or as root without capabilities)."""
    import shutil

    label = json.dumps({"answer": project["answer"]}) + "\n"
    if where == "right under /":
        folder = Path("/") / f"rlhf-test-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
        secret, targets = folder / "train.jsonl", [folder]
    else:
        folder = project["root"].parent / "big"
        (folder / "labels").mkdir(parents=True)
        for i in range(600):
            (folder / f"f{i}.jsonl").write_text(label if i == 7 else "{}\n")
        secret, targets = folder / "labels" / "train.jsonl", [folder / "f7.jsonl", folder / "labels"]
    try:
        secret.write_text(label)
        for path in (folder, secret.parent):
            path.chmod(0o755)
        registered(targets)
        for mode in ({}, {"drop_privileges": False}):
            seen, result = _read_all([secret, *targets], **mode)
            assert project["answer"] not in json.dumps(seen["reads"])
            assert all(isinstance(v, int) for v in seen["reads"].values()), seen["reads"]
            assert all(f"hidden:{t}" in result.isolation for t in targets), result.isolation
    finally:
        shutil.rmtree(folder)


@pytest.mark.unit
def test_what_an_editable_install_shows(tmp_path):
    """Packages (regular, namespace, compiled), modules, metadata and vendored libraries; not data,
    run folders, dotfiles or folders of non-code; and a .pth naming a system folder or one holding
    the installation is not taken for a project (restricting it would hide libraries)."""
    from rlhf.sandbox._sandbox_view import importable_entries, plan

    files = ["pkg/__init__.py", "ns/sub/mod.py", "compiled/_core.cpython-311-x86_64-linux-gnu.so", "single.py",
             "pkg-1.0.dist-info/METADATA", "proj.egg-info/PKG-INFO", "compiled.libs/libx.so", "data/train.jsonl",
             "runs/exp/samples.jsonl", ".git/HEAD", "notes/readme.md", "README.md", "pyproject.toml", "my-script.py"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    shown = [Path(p).name for p in importable_entries(str(tmp_path))]
    assert shown == ["compiled", "compiled.libs", "ns", "pkg", "pkg-1.0.dist-info", "proj.egg-info", "single.py"]
    install = tmp_path / "venv"
    install.mkdir()
    for source in ("/usr/lib", str(tmp_path)):  # a system folder; the folder holding the installation
        ops, visible = plan([str(install)], [source], [], [], None)
        assert not any(op[0] == "empty" for op in ops) and visible == [str(install)], ops


@pytest.mark.unit
@needs_namespaces
def test_a_hidden_path_that_is_a_mount_point_is_not_named_by_the_mount_table(project, registered):
    """A datasets cache on a file system of its own (a cluster's scratch mount): covered, its mount
    would still be listed in /proc/self/mountinfo; it leaves the sandbox's mount namespace."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a file system on the host needs root")
    cache = project["root"].parent / "hf" / "datasets"
    cache.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=755", "rlhf-test", str(cache)], check=True)
    try:
        arrow = cache / "train.arrow"
        arrow.write_text(project["answer"])
        arrow.chmod(0o644)
        before, _ = _read_all([arrow], hide_defaults=False)
        assert str(cache) in before["mountinfo"] and project["answer"] in json.dumps(before["reads"])
        registered([cache])
        seen, result = _read_all([arrow])
        assert seen["reads"] == {str(arrow): 2} and f"hidden:{cache}" in result.isolation
        assert str(cache) not in seen["mountinfo"], seen["mountinfo"]
        assert cache.is_mount() and arrow.read_text() == project["answer"]  # the host's mount is untouched
    finally:
        subprocess.run(["umount", str(cache)], check=True)
