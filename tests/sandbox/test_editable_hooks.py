"""Editable installs through an import hook (issue 55, item 5): setuptools' default mode on a flat
layout writes ``__editable___<name>_finder.py`` and a ``.pth`` that imports it; its strict mode a
link tree of symlinks under ``build/``. Sandboxed code imports the package, and nothing else of the
project exists inside (data, reward file, run folder; ``/proc/self/mountinfo`` does not name them).
A hook the sandbox does not understand hides its project whole, and says so in ``isolation``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.sandbox import run_code
from rlhf.sandbox._sandbox_editable import editable_installs
from tests.sandbox.test_hidden_run_data import READ_ALL, needs_namespaces

pytestmark = pytest.mark.unit

IMPORTING = "import pkg, os\nprint(pkg.VALUE, sorted(os.listdir(os.path.dirname(pkg.__path__[0]))))"


def _venv(root: Path) -> tuple[str, Path]:
    venv = root.parent / f"venv-{os.urandom(3).hex()}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_dir = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                              capture_output=True, text=True).stdout.strip()
    return str(python), Path(site_dir)


def _pip_install_editable(python: str, root: Path, mode: str | None) -> None:
    """``pip install -e`` offline, with this environment's setuptools as the build backend."""
    import setuptools

    backend = str(Path(setuptools.__file__).resolve().parents[1])
    extra = ["--config-settings", f"editable_mode={mode}"] if mode else []
    env = {**os.environ, "PYTHONPATH": backend, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    out = subprocess.run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", str(root), *extra],
                         env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        pytest.skip(f"pip could not make an editable install here: {out.stderr.strip().splitlines()[-1:]}")


@pytest.fixture(params=["finder", "strict", "unknown-hook"])
def hooked(project, request):
    """``project`` (a flat layout: ``pkg/`` beside ``data/``, ``rewards.py`` and ``runs/``) installed
    in editable mode through an import hook: setuptools' finder (its default mode here), its strict
    mode (a link tree of symlinks), or a hand-written hook the sandbox cannot read."""
    root = project["root"]
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (root / "rewards.py").write_text(f"ANSWER = {project['answer']!r}\n")
    (root / "runs" / "exp").mkdir(parents=True)
    (root / "runs" / "exp" / "samples.jsonl").write_text(json.dumps({"label": project["answer"]}) + "\n")
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "pkg"\nversion = "0.1"\n[tool.setuptools]\npackages = ["pkg"]\n')
    python, site_dir = _venv(root)
    if request.param == "unknown-hook":
        (site_dir / "_pkg_loader.py").write_text(f"import sys\n\ndef install():\n    sys.path.append({str(root)!r})\n")
        (site_dir / "_pkg_loader.pth").write_text("import _pkg_loader; _pkg_loader.install()\n")
    else:
        _pip_install_editable(python, root, "strict" if request.param == "strict" else None)
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    pth = sorted(p.name for p in site_dir.glob("*.pth") if p.name != "distutils-precedence.pth")
    finder = sorted(site_dir.glob("__editable___*_finder.py"))
    if request.param == "finder":
        assert finder and "MAPPING" in finder[0].read_text(), pth  # setuptools wrote a finder, as documented
    if request.param == "strict":
        assert not finder and (root / "build").is_dir(), pth  # a link tree, named by a path .pth line
    return {**project, "python": python, "mode": request.param, "rewards": root / "rewards.py",
            "samples": root / "runs" / "exp" / "samples.jsonl", "site_dir": site_dir}


def _run(hooked, code):
    result = run_code(code, timeout_s=30, python=hooked["python"])
    assert result.status in ("ok", "error"), result
    return result


@needs_namespaces
@pytest.mark.parametrize("project_hidden", [False, True], ids=["run-elsewhere", "run-in-project"])
def test_an_import_hook_editable_install_shows_its_package_and_nothing_else(hooked, registered, project_hidden):
    secrets = [hooked["data"], hooked["rewards"], hooked["samples"]]
    before = _run(hooked, f"PATHS = {json.dumps([str(p) for p in secrets])!r}\n" + READ_ALL)
    assert before.status == "ok" and hooked["answer"] not in before.stdout  # gone even when nothing is registered
    hidden = [hooked["data"], hooked["rewards"], *([hooked["root"]] if project_hidden else [])]
    registered(hidden)
    result = _run(hooked, f"PATHS = {json.dumps([str(p) for p in secrets])!r}\n" + READ_ALL)
    assert result.status == "ok", result
    seen = json.loads(result.stdout)
    assert hooked["answer"] not in json.dumps(seen["reads"])
    assert set(seen["reads"].values()) == {2}, seen["reads"]  # ENOENT: they do not exist inside
    for path in (hooked["data"], hooked["data"].parent, hooked["rewards"], hooked["samples"].parent):
        assert str(path) not in seen["mountinfo"], path  # the mount table does not say where to look
    for path in hidden:
        assert f"hidden:{path}" in result.isolation
    imported = _run(hooked, IMPORTING)
    if hooked["mode"] == "unknown-hook":  # fail closed: the whole project is gone, and isolation says why
        assert f"hidden:{hooked['root']}" in imported.isolation
        assert f"editable_hook_not_understood:{hooked['root']}" in imported.isolation
        assert imported.status == "error" and "ModuleNotFoundError" in imported.stderr, imported
        return
    assert imported.status == "ok" and imported.stdout == "42 ['pkg']\n", imported  # importable, and alone there
    listing = _run(hooked, f"import os\nprint(sorted(os.listdir({str(hooked['root'])!r})))")
    assert listing.stdout == ("['pkg']\n" if hooked["mode"] == "finder" else "['build', 'pkg']\n"), listing


@needs_namespaces
def test_without_the_hooked_install_the_project_is_readable(project):
    """The check above would pass vacuously if the project were unreadable anyway: with a plain
    venv (no editable install) and nothing hidden, the sandbox uid reads the data file."""
    (project["root"] / "pyproject.toml").write_text("[project]\nname = 'pkg'\n")
    python, _ = _venv(project["root"])
    result = run_code(f"print(open({str(project['data'])!r}).read())", timeout_s=30, python=python)
    assert result.status == "ok" and project["answer"] in result.stdout, result


def test_hooks_are_read_without_running_them(tmp_path):
    """setuptools' finder (MAPPING, top-level NAMESPACES) and the ``editables`` redirector
    (hatchling's and pdm's exact mode) are parsed into what they map; a hook that is neither
    names its project (to hide); a harmless ``import`` line naming no path is ignored. Nothing
    of them runs: each module would raise if imported."""
    site = tmp_path / "site"
    site.mkdir()
    proj = tmp_path / "proj"
    for folder in ("proj/pkg", "proj/src/other", "proj/nsa/ns", "meson/build", "meson/src/fast"):
        (tmp_path / folder).mkdir(parents=True)
    (proj / "pyproject.toml").write_text("")
    (tmp_path / "meson" / "meson.build").write_text("")
    (tmp_path / "meson" / "pyproject.toml").write_text("")
    (proj / "single.py").write_text("")
    (site / "__editable__.pkg-0.1.pth").write_text("import __editable___pkg_0_1_finder; "
                                                   "__editable___pkg_0_1_finder.install()\n")
    (site / "__editable___pkg_0_1_finder.py").write_text(
        "raise SystemExit('never run')\n"
        f"MAPPING: dict[str, str] = {{'pkg': {str(proj / 'pkg')!r}, 'single': {str(proj / 'single')!r}}}\n"
        f"NAMESPACES: dict[str, list[str]] = {{'ns': [{str(proj / 'nsa' / 'ns')!r}], 'pkg.sub': ['/x']}}\n")
    (site / "_other.pth").write_text("import _other\n")
    (site / "_other.py").write_text("raise SystemExit('never run')\nfrom editables.redirector import "
                                    "RedirectingFinder as F\nF.install()\n"
                                    f"F.map_module('other', {str(proj / 'src' / 'other' / '__init__.py')!r})\n")
    (site / "_fast_editable_loader.pth").write_text("import _fast_editable_loader\n")
    (site / "_fast_editable_loader.py").write_text(
        f"raise SystemExit('never run')\ninstall({{'fast': {{}}}}, {str(tmp_path / 'meson' / 'build')!r})\n")
    (site / "harmless.pth").write_text("import os; os.environ.get('X') and __import__('json')\n")
    loose = tmp_path / "loose" / "code"  # no project marker above it: the folder itself is hidden
    loose.mkdir(parents=True)
    (site / "zz_loose.pth").write_text(f"import sys; sys.path.append({str(loose)!r})\n")
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_modules"] == {"pkg": [str(proj / "pkg")], "single": [str(proj / "single")],
                                         "ns": [str(proj / "nsa" / "ns")], "other": [str(proj / "src" / "other")]}
    assert found["editable_paths"] == sorted(str(p) for p in (proj / "pkg", proj / "single.py", proj / "nsa" / "ns",
                                                              proj / "src" / "other"))
    assert found["editable_opaque"] == [str(loose), str(tmp_path / "meson")]
    assert found["editable_unknown"] == ["_fast_editable_loader.pth", "zz_loose.pth"]
    assert found["source_dirs"] == []


def test_a_mapped_package_hidden_on_purpose_stays_hidden(tmp_path):
    """What an import hook maps is shown, unless it is itself a hidden path, part of the installation
    (shown whole already) or missing; its project folder is emptied around what is shown."""
    from rlhf.sandbox._sandbox_view import plan

    proj, install = tmp_path / "proj", tmp_path / "venv"
    for folder in (proj / "pkg", proj / "secret_pkg", proj / "data", install / "inside"):
        folder.mkdir(parents=True)
    shown = [str(proj / "pkg"), str(proj / "secret_pkg"), str(install / "inside"), str(proj / "missing")]
    ops, visible = plan([str(install)], [], [], [str(proj / "secret_pkg")], None, shown, [str(proj)])
    assert visible == [str(install), str(proj / "pkg")]
    exposed = {path for kind, _, again in ops if kind in ("tmp", "tmpbind", "empty") for path in again}
    assert str(proj / "pkg") in exposed and not exposed & {str(proj / "secret_pkg"), str(proj / "data")}
