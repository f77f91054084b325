"""Editable installs through an import hook (issue 55, item 5): setuptools' default mode on a flat
layout writes ``__editable___<name>_finder.py`` and a ``.pth`` that imports it; its strict mode a
link tree of symlinks under ``build/``. Sandboxed code imports the package, and nothing else of the
project exists inside (data, reward file, run folder; ``/proc/self/mountinfo`` does not name them).
meson-python's loader and scikit-build-core's redirect are read too (their finders are not run
inside: nothing rebuilds there). A hook the sandbox does not understand, or one that computes its
paths when it runs, hides its project whole, and says so in ``isolation``."""

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


def _backend(module: str, *tools: str) -> str:
    """The folder holding a build backend (``mesonpy``, ``scikit_build_core``: the dev extra),
    or skip when it or a tool it runs is not installed here."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[dev]')")
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{module} needs {tool}, not found on PATH")
    return str(Path(spec.origin).resolve().parents[1])


def _pip_install_editable(python: str, root: Path, mode: str | None, backend: str | None = None) -> None:
    """``pip install -e`` offline, with this environment's setuptools (and pip) as the build
    backend, or with ``backend``'s folder on the path too."""
    import setuptools

    path = [str(Path(setuptools.__file__).resolve().parents[1]), *([backend] if backend else [])]
    extra = ["--config-settings", f"editable_mode={mode}"] if mode else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    out = subprocess.run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", str(root), *extra],
                         env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        pytest.skip(f"pip could not make an editable install here: {out.stderr.strip().splitlines()[-1:]}")


MESON_BUILD = """project('pkg', 'c', version: '0.1')
py = import('python').find_installation(pure: false)
py.install_sources('pkg/__init__.py', subdir: 'pkg')
py.extension_module('_speed', 'speed.c', install: true, subdir: 'pkg')
"""
SPEED_C = """#include <Python.h>
static PyObject *f(PyObject *self, PyObject *args) { return PyLong_FromLong(7); }
static PyMethodDef methods[] = {{"f", f, METH_NOARGS, ""}, {0}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speed", 0, -1, methods};
PyMODINIT_FUNC PyInit__speed(void) { return PyModule_Create(&module); }
"""
SKBUILD_CMAKE = """cmake_minimum_required(VERSION 3.15)
project(pkg LANGUAGES NONE)
file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/generated.py" "VALUE = 5\\n")
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/generated.py" DESTINATION pkg)
"""
RUNTIME_FINDER = """import json, os, sys
from importlib.machinery import PathFinder

with open(os.path.join(os.path.dirname(__file__), "__editable___pkg_map.json")) as f:
    MAPPING = json.load(f)  # computed when it runs: the sandbox cannot tell what it maps


class _Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname in MAPPING:
            return PathFinder.find_spec(fullname, [os.path.dirname(MAPPING[fullname])])


def install():
    sys.meta_path.append(_Finder)
"""


def _record_editable(site_dir: Path, root: Path, files: list[str]) -> None:
    """The dist-info pip writes for an editable install: ``direct_url.json`` (PEP 610) names the
    project, ``RECORD`` the files installed."""
    info = site_dir / "pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg\nVersion: 0.1\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "direct_url.json").write_text(json.dumps({"dir_info": {"editable": True}, "url": root.as_uri()}))
    (info / "RECORD").write_text("".join(f"{name},,\n" for name in [*files, *(f"{info.name}/{n}" for n in (
        "METADATA", "INSTALLER", "direct_url.json", "RECORD"))]))


@pytest.fixture(params=["finder", "strict", "meson", "skbuild", "unknown-hook", "runtime-hook"])
def hooked(project, request):
    """``project`` (a flat layout: ``pkg/`` beside ``data/``, ``rewards.py`` and ``runs/``; for
    scikit-build-core ``src/pkg/``, whose ``.pth`` names the package's parent folder too) installed
    in editable mode through an import hook: setuptools' finder (its default mode here), its strict
    mode (a link tree of symlinks), meson-python's loader (with an extension module built in the
    project's ``build/``), scikit-build-core's redirect, a hand-written hook the sandbox cannot
    read, or a setuptools-like finder whose mapping is read from a file when it runs."""
    root = project["root"]
    package = root / "src" / "pkg" if request.param == "skbuild" else root / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 42\n")
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
    elif request.param == "runtime-hook":  # nothing in its text names the project: pip's record does
        (site_dir / "__editable___pkg_0_1_finder.py").write_text(RUNTIME_FINDER)
        (site_dir / "__editable___pkg_map.json").write_text(json.dumps({"pkg": str(root / "pkg")}))
        (site_dir / "__editable__.pkg-0.1.pth").write_text(
            "import __editable___pkg_0_1_finder; __editable___pkg_0_1_finder.install()\n")
        _record_editable(site_dir, root, ["__editable___pkg_0_1_finder.py", "__editable___pkg_map.json",
                                          "__editable__.pkg-0.1.pth"])
        host = subprocess.run([python, "-c", "import pkg; print(pkg.VALUE)"], capture_output=True, text=True)
        assert host.stdout == "42\n", host  # the hook works outside the sandbox
    elif request.param == "meson":
        backend = _backend("mesonpy", "meson", "ninja", "cc")
        (root / "meson.build").write_text(MESON_BUILD)
        (root / "speed.c").write_text(SPEED_C)
        (root / "pyproject.toml").write_text('[build-system]\nrequires = ["meson-python"]\nbuild-backend = "mesonpy"\n'
                                             '[project]\nname = "pkg"\nversion = "0.1"\n')
        _pip_install_editable(python, root, None, backend)
    elif request.param == "skbuild":
        backend = _backend("scikit_build_core", "cmake")
        (root / "CMakeLists.txt").write_text(SKBUILD_CMAKE)
        (root / "pyproject.toml").write_text('[build-system]\nrequires = ["scikit-build-core"]\n'
                                             'build-backend = "scikit_build_core.build"\n'
                                             '[project]\nname = "pkg"\nversion = "0.1"\n')
        _pip_install_editable(python, root, None, backend)
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
    if request.param == "meson":  # meson-python's loader, its build folder in the project
        assert "MesonpyMetaFinder(" in (site_dir / "_pkg_editable_loader.py").read_text(), pth
        assert (root / "build" / "cp311" / "meson-info" / "intro-install_plan.json").is_file()
    if request.param == "skbuild":  # scikit-build-core's redirect (and the package's parent folder)
        assert "install({" in (site_dir / "_editable_skbc_pkg.py").read_text(), pth
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
    if hooked["mode"] in ("unknown-hook", "runtime-hook"):  # fail closed: the project is gone, isolation says why
        assert f"hidden:{hooked['root']}" in imported.isolation
        assert f"editable_hook_not_understood:{hooked['root']}" in imported.isolation
        assert imported.status == "error" and "ModuleNotFoundError" in imported.stderr, imported
        return
    assert not [layer for layer in imported.isolation if layer.startswith("editable_hook_not_understood:")]
    alone = "42 ['build', 'pkg']\n" if hooked["mode"] == "meson" else "42 ['pkg']\n"  # meson's build folder too
    assert imported.status == "ok" and imported.stdout == alone, imported  # importable, and alone there
    listing = _run(hooked, f"import os\nprint(sorted(os.listdir({str(hooked['root'])!r})))")
    in_root = {"finder": "['pkg']\n", "skbuild": "['src']\n"}.get(hooked["mode"], "['build', 'pkg']\n")
    assert listing.stdout == in_root, listing
    if hooked["mode"] == "skbuild":  # a module CMake installed beside the sources' package (in site-packages)
        generated = _run(hooked, "import pkg.generated\nprint(pkg.generated.VALUE)")
        assert generated.status == "ok" and generated.stdout == "5\n", generated
    if hooked["mode"] == "meson":  # the extension module from the build folder, and nothing else of that folder
        build = hooked["root"] / "build" / "cp311"
        built = _run(hooked, f"import os, pkg._speed\nprint(pkg._speed.f(), os.listdir({str(build)!r}))")
        extension = [p.name for p in build.glob("_speed*") if p.is_file()]
        assert built.status == "ok" and built.stdout == f"7 {extension}\n", built


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


# --- hooks whose paths are computed when they run: fail closed --------------------------------------

SETUPTOOLS_TAIL = "\ndef install():\n    import sys\n    sys.meta_path.append(object())\n"
COMPUTED = {  # module text (PROJ: the project's path, written only where the shape names it)
    "mapping-from-a-call": "def _mapping():\n    return {'pkg': PROJ + '/pkg'}\n\nMAPPING = _mapping()\n",
    "mapping-from-a-file": "import json, os\n\nwith open(os.path.join(os.path.dirname(__file__), 'map.json')) as f:\n"
                           "    MAPPING = json.load(f)\n",
    "mapping-from-the-environment": "import os\n\nMAPPING = {'pkg': os.environ['PKG_ROOT'] + '/pkg'}\n",
    "empty-mapping-filled-later": "import os\n\nMAPPING = {}\nMAPPING.update(pkg=os.environ['PKG_ROOT'])\n",
    "mapping-item-set-later": "import os\n\nMAPPING: dict[str, str] = {}\nMAPPING['pkg'] = os.environ['PKG_ROOT']\n",
    "mapping-replaced-in-install": "MAPPING = {}\n\ndef _fill():\n    global MAPPING\n    MAPPING = {'pkg': '/x'}\n",
    "mapping-aliased": "import os\n\nMAPPING = {}\n_m = MAPPING\n_m['pkg'] = os.environ['PKG_ROOT']\n",
    "mapping-merged": "import os\n\nMAPPING = {}\nMAPPING |= {'pkg': os.environ['PKG_ROOT']}\n",
    "map-module-computed": "import os\nfrom editables.redirector import RedirectingFinder as F\nF.install()\n"
                           "F.map_module('pkg', os.path.join(os.environ['PKG_ROOT'], 'pkg', '__init__.py'))\n",
    "map-module-in-a-loop": "import json\nfrom editables.redirector import RedirectingFinder as F\nF.install()\n"
                            "for name, path in json.load(open('/etc/map.json')).items():\n"
                            "    F.map_module(name, path)\n",
    "meson-build-folder-computed": "import os\n\nclass MesonpyMetaFinder:\n"
                                   "    def __init__(self, package, names, path, cmd, verbose=False):\n        pass\n\n"
                                   "def install():\n"
                                   "    MesonpyMetaFinder('pkg', {'pkg'}, os.environ['BUILD'], ['ninja'], False)\n",
    "skbuild-mapping-from-a-file": "import json\n\nclass ScikitBuildRedirectingFinder:\n    pass\n\n"
                                   "def install(known_source_files, known_wheel_files, path=None):\n    pass\n\n"
                                   "install(json.load(open('map.json')), {}, None)\n",
    "sys-path-from-the-environment": "import os, sys\n\ndef install():\n    sys.path.append(os.environ['PKG_ROOT'])\n",
    "mapping-relative-to-the-working-directory": "MAPPING = {'pkg': 'proj/pkg'}\n",
    "mapping-assigned-twice": "MAPPING = {'pkg': PROJ}\nMAPPING = {'pkg': '/elsewhere/pkg'}\n",
    "map-module-not-of-strings": "from editables.redirector import RedirectingFinder as F\nF.map_module('pkg', None)\n"
                                 "# an unterminated quote: '/\n",
    "map-module-with-computed-keywords": "import os\nfrom editables.redirector import RedirectingFinder as F\n"
                                         "F.install()\nF.map_module('pkg', PROJ, **os.environ)\n",
    "mapping-of-a-name-that-is-not-one": "MAPPING = {'not-a-name': PROJ + '/pkg'}\n".replace(" + '/pkg'", ""),
}


def _site_with_hook(tmp_path, module_text, line="import _hook; _hook.install()", recorded=True, package=False):
    """A site-packages folder with ``_hook.py`` (``package``: ``_hook/__init__.py``) imported by
    ``_hook.pth``; ``recorded``: pip's dist-info for it (``direct_url.json`` naming the project, its
    URL quoted as pip quotes it, ``RECORD`` the files)."""
    site, project = tmp_path / "site", tmp_path / "my proj é"
    (project / "pkg").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    site.mkdir()
    (site / "map.json").write_text(json.dumps({"pkg": str(project / "pkg")}))
    module = site / "_hook" / "__init__.py" if package else site / "_hook.py"
    module.parent.mkdir(exist_ok=True)
    module.write_text("raise SystemExit('never run')\n" + module_text.replace("PROJ", repr(str(project))))
    (site / "_hook.pth").write_text(line + "\n")
    if recorded:
        _record_editable(site, project, [str(module.relative_to(site)), "_hook.pth"])
    return site, project


@pytest.mark.parametrize("shape", sorted(COMPUTED))
def test_a_hook_that_computes_its_paths_hides_its_project(tmp_path, shape):
    """Each shape would map ``pkg`` when run; read without running it, none has a literal mapping:
    the hook is not understood, nothing of it is shown, and the project pip recorded for it is hidden
    whole (its module's text does not name it)."""
    site, project = _site_with_hook(tmp_path, COMPUTED[shape] + SETUPTOOLS_TAIL)
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == ["_hook.pth"]
    assert found["editable_opaque"] == [str(project)]
    assert found["editable_modules"] == {} and found["editable_redirects"] == {} and found["editable_paths"] == []


@pytest.mark.parametrize("line", ["import _hook; _hook.install(__import__('os').environ['PKG_ROOT'])",
                                  "import sys, os; sys.path.insert(0, os.environ['PKG_ROOT'])",
                                  "import os; exec(open(os.environ['HOOK']).read())",
                                  "import zipimport; zipimport.zipimporter(__import__('os').environ['Z'])"])
def test_an_import_line_that_computes_its_paths_hides_its_project(tmp_path, line):
    """The ``.pth`` line itself computes: passes a computed value to a hook that is understood, or
    changes ``sys.path`` or runs code from a computed place."""
    site, project = _site_with_hook(tmp_path, "MAPPING = {'pkg': PROJ + '/pkg'}\n".replace(" + '/pkg'", "")
                                    + "def install(root=None):\n    pass\n", line=line)
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == ["_hook.pth"]
    assert found["editable_opaque"] == [str(project)]
    assert found["editable_modules"] == {}


def test_a_computed_argument_to_a_literal_hook_hides_the_project_it_names(tmp_path):
    """Not recorded by any installer: the project is the one the hook's own literal mapping names."""
    site, project = _site_with_hook(tmp_path, "MAPPING = {'pkg': PROJ}\ndef install(root=None):\n    pass\n",
                                    line="import _hook; _hook.install(__import__('os').environ['X'])", recorded=False)
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == ["_hook.pth"] and found["editable_opaque"] == [str(project)]
    (site / "_hook.py").write_text("MAPPING = {'pkg': '/nowhere/pkg'}\n")  # naming nothing that exists: still listed
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == ["_hook.pth"]
    assert found["editable_opaque"] == [] and found["editable_modules"] == {}


NO_RECORD = {
    "mapping-from-the-environment": COMPUTED["mapping-from-the-environment"] + SETUPTOOLS_TAIL,
    "zip-archive-from-the-environment": "from zipimport import zipimporter as _z\nimport os\n\ndef install():\n"
                                        "    _z(os.environ['ZIP']).load_module('pkg')\n",
    "sys-path-imported-by-name": "from sys import path as _p\nimport os\n\ndef install():\n"
                                 "    _p.append(os.environ['PKG_ROOT'])\n",
    "meta-path-imported-by-name": "from sys import meta_path as _m\nimport os\n\ndef install():\n"
                                  "    _m.append(os.environ['FINDER'])\n",
    "sys-path-from-the-environment": COMPUTED["sys-path-from-the-environment"],
    "code-run-from-the-environment": "import os\n\ndef install():\n    exec(open(os.environ['HOOK']).read())\n",
}


@pytest.mark.parametrize("shape", sorted(NO_RECORD))
def test_a_computing_hook_no_installer_recorded_is_listed_with_nothing_to_hide(tmp_path, shape):
    """Without pip's record and without a path in its text, the project cannot be told: the hook is
    listed as not understood (never as understood with an empty mapping) and nothing of it shown."""
    site, _ = _site_with_hook(tmp_path, NO_RECORD[shape], recorded=False)
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == ["_hook.pth"]
    assert found["editable_opaque"] == [] and found["editable_modules"] == {} and found["editable_paths"] == []


def test_a_module_no_installer_recorded_that_touches_no_import_machinery_is_left_alone(tmp_path):
    """A ``.pth`` line importing a module that reads the environment and touches nothing of the
    import system, installed by no editable distribution: no hook, nothing listed or hidden."""
    site, _ = _site_with_hook(tmp_path, "from os import environ\n\ndef install():\n    return environ.get('X')\n",
                              recorded=False)
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == [] and found["editable_opaque"] == []


def test_pips_file_urls_are_unquoted_as_urllib_does():
    from urllib.parse import unquote as reference

    from rlhf.sandbox._sandbox_editable import unquote

    for text in ("/my%20proj%20%C3%A9", "/a%2x%41%", "/100%25/%zz%4", "/plain", "%"):
        assert unquote(text) == reference(text, errors="surrogateescape"), text


def test_an_unknown_hook_pip_installed_as_editable_hides_its_project(tmp_path):
    """A hook that reaches no part of the import system the sandbox knows of, but that pip installed
    for an editable project: not understood, that project hidden. The same module installed by no
    editable distribution is left alone (``harmless.pth`` above)."""
    site, project = _site_with_hook(tmp_path, "import os\n\ndef install():\n    os.environ.setdefault('X', '1')\n")
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == ["_hook.pth"] and found["editable_opaque"] == [str(project)]
    for url in ("file:///var/tmp", (tmp_path / "gone").as_uri()):  # no project there: nothing to hide
        (site / "pkg-0.1.dist-info" / "direct_url.json").write_text(json.dumps({"url": url,
                                                                               "dir_info": {"editable": True}}))
        found = editable_installs([str(site)], [str(site)])
        assert found["editable_unknown"] == ["_hook.pth"] and found["editable_opaque"] == [], url
    (site / "pkg-0.1.dist-info" / "direct_url.json").write_text(json.dumps({"url": project.as_uri(), "dir_info": {}}))
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == [] and found["editable_opaque"] == []


def test_a_hook_package_that_computes_its_paths_hides_its_project(tmp_path):
    """The hook a ``.pth`` imports may be a package (``_hook/__init__.py``): pip's record names it so."""
    site, project = _site_with_hook(tmp_path, COMPUTED["mapping-from-the-environment"] + SETUPTOOLS_TAIL, package=True)
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == ["_hook.pth"] and found["editable_opaque"] == [str(project)]


@pytest.mark.parametrize("line", ["import _hook; _hook.install()", "import os; __import__('_hook.sub').install()",
                                  "import os; from _hook.sub import install; install()"])
def test_a_literal_hook_installed_by_pip_is_understood(tmp_path, line):
    """The same site with a literal mapping: understood, pip's record notwithstanding; a byte that is
    not UTF-8 in a comment does not stop it being read."""
    site, project = _site_with_hook(tmp_path, "MAPPING = {'pkg': PKG}\nNAMESPACES = {}\n" + SETUPTOOLS_TAIL
                                    + "\ndef find(name):\n    return MAPPING.get(name) or NAMESPACES.items()\n",
                                    line=line)
    text = (site / "_hook.py").read_text().replace("PKG", repr(str(project / "pkg")))
    (site / "_hook.py").write_bytes(b"# caf\xe9\n" + text.encode())
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == [] and found["editable_opaque"] == []
    assert found["editable_modules"] == {"pkg": [str(project / "pkg")]}
    assert found["editable_paths"] == [str(project / "pkg")]


# --- meson-python and scikit-build-core, as their versions write them --------------------------------

MESON_LOADER_0_22 = """import sys

class MesonpyMetaFinder:
    def __init__(self, package, names, path, cmd, verbose=False):
        self._build_path = path

def init():
    finder = MesonpyMetaFinder(
        'fast',
        {'fast'},
        BUILD,
        ['/usr/bin/ninja'],
        False,
    )
    sys.meta_path.insert(0, finder)
    sys.path_hooks.insert(0, finder._path_hook)
"""
MESON_LOADER_0_13 = """import sys

class MesonpyMetaFinder:
    def __init__(self, names, path, cmd, verbose=False):
        self._build_path = path

def install(names, path, cmd, verbose=False):
    sys.meta_path.insert(0, MesonpyMetaFinder(names, path, cmd, verbose))

install({'fast'}, BUILD, ['ninja'], False)
"""
SKBUILD_1 = """import os, sys

class ScikitBuildRedirectingFinder:
    pass

def install(known_source_files, known_wheel_files, known_directories=None, known_packages=None, path=None,
            rebuild=False, verbose=False, build_options=None, install_options=None, install_dir=""):
    sys.meta_path.insert(0, ScikitBuildRedirectingFinder())

def install_inplace(known_packages, search_paths, path=None, rebuild=False, verbose=False, build_options=None):
    pass

CALL
"""
SKBUILD_0_10 = """import sys

class ScikitBuildRedirectingFinder:
    pass

def install(known_source_files, known_wheel_files, path, rebuild=False, verbose=False, build_options=None,
            install_options=None, install_dir=""):
    sys.meta_path.insert(0, ScikitBuildRedirectingFinder())

CALL
"""


def _meson_project(tmp_path):
    """A meson-python project's source and build folders and the install plan meson writes
    (``meson-info/intro-install_plan.json``: a source module, an extension module built in the
    build folder, an ``install_subdir`` with an excluded file, a header installed elsewhere)."""
    project, build = tmp_path / "meson", tmp_path / "meson" / "build" / "cp311"
    for folder in (project / "src" / "fast" / "sub", project / "src" / "fast" / "data", build / "meson-info"):
        folder.mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    for name in ("src/fast/__init__.py", "src/fast/sub/__init__.py", "src/fast/data/x.json", "src/fast/data/skip.txt",
                 "build/cp311/_speed.cpython-311-x86_64-linux-gnu.so", "build/cp311/build.ninja", "secret.txt",
                 "src/fast/sub/mod.py"):
        (project / name).write_text("")
    src = project / "src" / "fast"
    plan = {
        "targets": {str(build / "_speed.cpython-311-x86_64-linux-gnu.so"): {
            "destination": "{py_platlib}/fast/_speed.cpython-311-x86_64-linux-gnu.so", "tag": "runtime",
            "subproject": None, "install_rpath": None, "build_rpaths": []}},
        "python": {str(src / "__init__.py"): {"destination": "{py_platlib}/fast/__init__.py",
                                              "tag": "python-runtime", "subproject": None},
                   str(src / "sub" / "__init__.py"): {"destination": "{py_platlib}/fast/sub/__init__.py",
                                                      "tag": "python-runtime", "subproject": None},
                   str(src / "sub" / "mod.py"): {"destination": "{py_platlib}/fast/sub/renamed.py",
                                                 "tag": "python-runtime", "subproject": None}},
        "install_subdirs": {str(src / "data"): {"destination": "{py_platlib}/fast/data", "tag": None,
                                                "subproject": None, "exclude_dirs": [],
                                                "exclude_files": ["skip.txt"]}},
        "headers": {str(project / "secret.txt"): {"destination": "{includedir}/secret.txt", "tag": "devel"}},
    }
    (build / "meson-info" / "intro-install_plan.json").write_text(json.dumps(plan, indent=4))
    return project, build


@pytest.mark.parametrize("version", ["0.22", "0.13"])
def test_meson_python_loader_and_install_plan(tmp_path, version):
    """meson-python's loader names the build folder in a literal call (``init()`` building a
    ``MesonpyMetaFinder`` since 0.14, a module-level ``install(...)`` before); what it maps is meson's
    install plan there: each module by its dotted name, from the sources or the build folder. Shown:
    the package's source folder, and the extension module alone of the build folder."""
    project, build = _meson_project(tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    loader = MESON_LOADER_0_22 if version == "0.22" else MESON_LOADER_0_13
    (site / "_fast_editable_loader.py").write_text("raise SystemExit('never run')\n" +
                                                    loader.replace("BUILD", repr(str(build))))
    (site / "fast-editable.pth").write_text("import _fast_editable_loader; _fast_editable_loader.init()\n"
                                            if version == "0.22" else "import _fast_editable_loader\n")
    found = editable_installs([str(site)], [str(site)])
    src = project / "src" / "fast"
    assert found["editable_redirects"] == {
        "fast": [str(src / "__init__.py"), [str(src)]],
        "fast._speed": [str(build / "_speed.cpython-311-x86_64-linux-gnu.so"), None],
        "fast.data": [None, []],  # a folder of data: a namespace package, as meson's finder makes it
        "fast.sub": [str(src / "sub" / "__init__.py"), [str(src / "sub")]],
        "fast.sub.renamed": [str(src / "sub" / "mod.py"), None],
    }
    assert found["editable_paths"] == [str(build / "_speed.cpython-311-x86_64-linux-gnu.so"), str(src)]
    assert found["editable_unknown"] == [] and found["editable_opaque"] == [] and found["editable_modules"] == {}
    from rlhf.sandbox._sandbox_editable import install_plan_files, project_roots

    assert project_roots(found["source_dirs"], found["editable_paths"], [str(site)]) == [str(project)]
    assert sorted(install_plan_files(str(build), {"fast"})) == [  # the header is not imported, skip.txt excluded
        ("fast", "__init__.py"), ("fast", "_speed.cpython-311-x86_64-linux-gnu.so"), ("fast", "data", "x.json"),
        ("fast", "sub", "__init__.py"), ("fast", "sub", "renamed.py")]
    assert install_plan_files(str(build), {"other"}) == {}  # another package's: not this finder's


@pytest.mark.parametrize("names", ["{'fast', 'not-a-name'}", "set()", "'fast'"])
def test_meson_python_loader_with_odd_names_is_not_understood(tmp_path, names):
    project, build = _meson_project(tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    loader = MESON_LOADER_0_22.replace("BUILD", repr(str(build))).replace("{'fast'}", names)
    (site / "_fast_editable_loader.py").write_text(loader)
    (site / "fast-editable.pth").write_text("import _fast_editable_loader; _fast_editable_loader.init()\n")
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == ["fast-editable.pth"] and found["editable_opaque"] == [str(project)]


def test_meson_python_without_its_plan_is_not_understood(tmp_path):
    """No install plan in the build folder (deleted, or never configured): the loader cannot be read,
    the project is hidden (its build folder is named in the loader)."""
    project, build = _meson_project(tmp_path)
    (build / "meson-info" / "intro-install_plan.json").write_text("{not json")
    site = tmp_path / "site"
    site.mkdir()
    (site / "_fast_editable_loader.py").write_text(MESON_LOADER_0_22.replace("BUILD", repr(str(build))))
    (site / "fast-editable.pth").write_text("import _fast_editable_loader; _fast_editable_loader.init()\n")
    found = editable_installs([str(site)], [str(site)])
    assert found["editable_unknown"] == ["fast-editable.pth"] and found["editable_opaque"] == [str(project)]
    assert found["editable_redirects"] == {}


@pytest.mark.parametrize("version", ["1.x", "0.10"])
def test_scikit_build_core_redirect(tmp_path, version):
    """scikit-build-core's redirect: the install call's arguments bound by its own ``def``
    (``known_directories`` since 1.0; before, a package's folders are those of its modules): sources
    by absolute path, the wheel's files relative to site-packages. A source folder that is not the
    package's own (a package whose ``__init__`` sits in the project's root) is not shown whole."""
    project, site = tmp_path / "proj", tmp_path / "site"
    for folder in (project / "src" / "pkg", site / "pkg"):
        folder.mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    for name in ("src/pkg/__init__.py", "src/pkg/mod.py", "flat.py"):
        (project / name).write_text("")
    (site / "pkg" / "_core.so").write_text("")
    src = project / "src" / "pkg"
    sources = {"pkg": str(src / "__init__.py"), "pkg.mod": str(src / "mod.py"), "flat": str(project / "flat.py")}
    wheel = {"pkg._core": "pkg/_core.so"}
    if version == "1.x":
        call = (f"install({sources!r}, {wheel!r}, {{'pkg': [{str(src)!r}, 'pkg'], 'odd': [{str(project)!r}]}}, "
                "['pkg'], None, False, True, [], [], '')")
        template = SKBUILD_1
    else:
        call = f"install({sources!r}, {wheel!r}, None, False, True, [], [], '')"
        template = SKBUILD_0_10
    (site / "_editable_skbc_pkg.py").write_text("raise SystemExit('never run')\n" + template.replace("CALL", call))
    (site / "_editable_skbc_pkg.pth").write_text(f"import _editable_skbc_pkg\n{project / 'src'}\n")
    found = editable_installs([str(site)], [str(site)])
    expected = {"pkg": [str(src / "__init__.py"), [str(src), str(site / "pkg")]],
                "pkg.mod": [str(src / "mod.py"), None], "flat": [str(project / "flat.py"), None],
                "pkg._core": [str(site / "pkg" / "_core.so"), None]}
    if version == "1.x":
        expected["odd"] = [None, []]  # its folder is the project's root: not shown, not searched
    assert found["editable_redirects"] == expected
    assert found["editable_paths"] == sorted([str(project / "flat.py"), str(src), str(site / "pkg")])
    assert found["source_dirs"] == [str(project / "src")]  # its .pth names the package's parent folder too
    assert found["editable_unknown"] == [] and found["editable_opaque"] == []
    if version == "1.x":  # known_directories of another shape: not understood
        for odd in ("{'pkg': 'src'}", "{'pkg': [1]}", "{1: ['pkg']}", "['pkg']"):
            (site / "_editable_skbc_pkg.py").write_text(template.replace("CALL", call.replace(
                f"{{'pkg': [{str(src)!r}, 'pkg'], 'odd': [{str(project)!r}]}}", odd)))
            found = editable_installs([str(site)], [str(site)])
            assert found["editable_unknown"] == ["_editable_skbc_pkg.pth"], odd
            assert found["editable_redirects"] == {} and found["editable_opaque"] == [str(project)], odd


def test_scikit_build_core_inplace_and_a_start_file(tmp_path):
    """In place: imports come from the search paths (shown as path lines are); Python 3.15's
    ``.start`` files (PEP 829: ``module:callable``) are read like the ``import`` lines they replace."""
    project, site = tmp_path / "proj", tmp_path / "site"
    (project / "src" / "pkg").mkdir(parents=True)
    site.mkdir()
    (project / "pyproject.toml").write_text("")
    (project / "src" / "pkg" / "__init__.py").write_text("")
    call = f"install_inplace(['pkg'], [{str(project / 'src')!r}], {str(project)!r}, False, True, [])"
    entry = SKBUILD_1.replace("CALL", f"def entrypoint():\n    {call}\n")
    (site / "_editable_skbc_pkg.py").write_text("raise SystemExit('never run')\n" + entry)
    (site / "_editable_skbc_pkg.start").write_text("\ufeff_editable_skbc_pkg:entrypoint\n", encoding="utf-8")
    (site / "odd.start").write_text("not a name!\n")
    found = editable_installs([str(site)], [str(site)])
    assert found["source_dirs"] == [str(project / "src")]
    assert found["editable_redirects"] == {} and found["editable_opaque"] == []
    assert found["editable_unknown"] == ["odd.start"]
