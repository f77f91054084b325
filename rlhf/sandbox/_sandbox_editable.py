"""Editable installs, read from site-packages without running anything: what each makes
importable and which project folder it comes from.

Used by ``_sandbox_view.python_layout`` (host side, or the supervisor for another interpreter)
so that sandboxed code sees an editable install's importable code and nothing else of its
project. Three kinds of ``.pth`` lines:

- a **path** line (hatchling, pdm, flit, setuptools' compat mode and its strict mode, whose
  path is a "link tree" ``build/__editable__.*`` of symlinks into the project): the folder goes
  on the code's ``sys.path``; only its importable entries are shown, and for a link tree the
  package folders its symlinks point into;
- an **import** line whose module is understood: setuptools' finder
  (``__editable___<name>_finder.py``: literal ``MAPPING`` and ``NAMESPACES`` dicts) or the
  ``editables`` redirector (hatchling's and pdm's exact mode: ``F.map_module(name, path)``
  calls with literal arguments). The modules are parsed (``compile(..., PyCF_ONLY_AST)``),
  never imported or run; the code's process gets an equivalent finder (``_sandbox_code``);
- an import line not understood (meson-python, scikit-build-core, hand-written hooks): every
  absolute path its line and module name that lies outside the installation and system
  folders is taken to be a project, and that project is hidden whole (fail closed).

Each shown path's project (the nearest folder above it holding ``pyproject.toml``,
``setup.py``, ``setup.cfg`` or ``.git``, at most four levels up) is emptied in the code's view
with only the shown paths bound back: its data, reward files and run folders do not exist there.
Standard library only, cheap imports only (no ``ast``: it imports ``enum``).
"""

import os

PyCF_ONLY_AST = 0x400  # ast.PyCF_ONLY_AST, without importing ast
PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
PROJECT_LEVELS = 4  # how far above a shown path its project's marker is looked for
MAX_HOOK_BYTES = 4 << 20  # a hook module larger than this is not parsed (not understood)
MAX_LINK_TREE_ENTRIES = 20_000
NOT_A_PROJECT = ("/proc", "/sys", "/dev", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/boot",
                 "/run", "/var/lib/dpkg")  # nothing under these is a project
NEVER_A_PROJECT = frozenset({"/", "/tmp", "/var", "/var/tmp", "/var/lib", "/home", "/root", "/opt", "/srv", "/mnt",
                             "/media"})  # these folders themselves are not


def under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


def read_pth(path):
    """(path lines, import lines) of one ``.pth`` file, as ``site`` reads it: comments and blank
    lines skipped, a line starting with ``import`` run, any other line a folder relative to
    site-packages; path lines that are not folders are dropped."""
    directory = os.path.dirname(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f]
    except (OSError, UnicodeDecodeError):
        return [], []
    paths, imports = [], []
    for line in lines:
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith(("import ", "import\t")):
            imports.append(line)
            continue
        folder = os.path.join(directory, line.rstrip())
        if os.path.isdir(folder):
            paths.append(os.path.abspath(folder))
    return paths, imports


# --- import hooks ------------------------------------------------------------------------------


def parse(source, filename):
    try:
        return compile(source, filename, "exec", PyCF_ONLY_AST, dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


def literal(node):
    """The value of a literal made of strings, lists, tuples and dicts (else ``ValueError``)."""
    kind = type(node).__name__
    if kind == "Constant" and isinstance(node.value, str):
        return node.value
    if kind in ("List", "Tuple"):
        return [literal(e) for e in node.elts]
    if kind == "Dict" and None not in node.keys:
        return {literal(k): literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(kind)


def walk(node):
    """Every node under ``node`` (``ast.walk`` without importing ``ast``)."""
    todo = [node]
    while todo:
        node = todo.pop()
        yield node
        for name in getattr(node, "_fields", ()):
            value = getattr(node, name, None)
            if isinstance(value, list):
                todo.extend(v for v in value if hasattr(v, "_fields"))
            elif hasattr(value, "_fields"):
                todo.append(value)


def imported_names(tree):
    """Top-level module names an import line brings in (``import x``, ``from x import``,
    ``__import__('x')``)."""
    names = []
    for node in walk(tree):
        kind = type(node).__name__
        if kind == "Import":
            names += [a.name.partition(".")[0] for a in node.names]
        elif kind == "ImportFrom" and node.module and not node.level:
            names.append(node.module.partition(".")[0])
        elif (kind == "Call" and type(node.func).__name__ == "Name" and node.func.id == "__import__" and node.args
              and type(node.args[0]).__name__ == "Constant" and isinstance(node.args[0].value, str)):
            names.append(node.args[0].value.partition(".")[0])
    return names


def module_file(name, site_dirs):
    for directory in site_dirs:
        for candidate in (os.path.join(directory, name + ".py"), os.path.join(directory, name, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def hook_modules(tree):
    """What a hook module maps, ``{top-level name: [paths]}``, or None when it is neither
    setuptools' finder nor the ``editables`` redirector. A package maps to its folder, a module
    to its file (or the file's path without suffix, as setuptools writes it), a namespace
    package to several folders."""
    mapping = namespaces = None
    redirected = {}
    for node in tree.body:
        kind = type(node).__name__
        target = (node.target if kind == "AnnAssign"
                  else node.targets[0] if kind == "Assign" and len(node.targets) == 1 else None)
        if target is not None and type(target).__name__ == "Name" and node.value is not None:
            try:
                if target.id == "MAPPING":
                    mapping = literal(node.value)
                elif target.id == "NAMESPACES":
                    namespaces = literal(node.value)
            except ValueError:
                return None
    for node in walk(tree):
        if (type(node).__name__ == "Call" and type(node.func).__name__ == "Attribute" and node.func.attr == "map_module"
                and len(node.args) == 2 and not node.keywords):
            try:
                name, path = literal(node.args[0]), literal(node.args[1])
            except ValueError:
                return None
            if not (isinstance(name, str) and isinstance(path, str)):
                return None
            if os.path.basename(path) == "__init__.py":
                path = os.path.dirname(path)
            redirected.setdefault(name, []).append(path)
    if mapping is None and not redirected:
        return None
    out = {}
    if mapping is not None:
        if not (isinstance(mapping, dict) and all(isinstance(v, str) for v in mapping.values())):
            return None
        out.update({k: [v] for k, v in mapping.items()})
        if isinstance(namespaces, dict):  # top-level namespace packages only: nested ones import on their own
            for name, paths in namespaces.items():
                if "." not in name and isinstance(paths, list) and name not in out:
                    out[name] = [p for p in paths if isinstance(p, str)]
    for name, paths in redirected.items():
        if "." not in name:
            out.setdefault(name, []).extend(p for p in paths if p not in out.get(name, ()))
    if not all(isinstance(k, str) and k.isidentifier() and all(os.path.isabs(p) for p in v) for k, v in out.items()):
        return None
    return out


def absolute_paths(text):
    """Every quoted absolute path in ``text`` (a hook that is not understood: where it may read)."""
    found = set()
    for quote in ("'", '"'):
        start = text.find(quote + "/")
        while start != -1:
            end = text.find(quote, start + 1)
            if end == -1:
                break
            value = text[start + 1:end]
            if "\n" not in value and len(value) < 4096:
                found.add(os.path.normpath(value))
            start = text.find(quote + "/", end + 1)
    return found


def shown_files(path):
    """What a mapped path makes importable: a folder, or a module's file (``path`` itself, or
    ``path`` with a module suffix, as setuptools' finder looks it up)."""
    if os.path.isdir(path) or os.path.isfile(path):
        return [path]
    from importlib.machinery import all_suffixes

    stem = os.path.splitext(path)[0]
    return [stem + s for s in all_suffixes() if os.path.isfile(stem + s)]


# --- link trees (setuptools' strict mode) ---------------------------------------------------


def link_targets(source):
    """The folders (or files) the symlinks of a link tree point into, each package's folder once:
    ``pkg/sub/mod.py -> /project/src/pkg/sub/mod.py`` shows ``/project/src/pkg``."""
    out, seen = set(), 0
    todo = [source]
    while todo and seen < MAX_LINK_TREE_ENTRIES:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if entry.is_symlink():
                target = os.path.realpath(entry.path)
                if not os.path.exists(target):
                    continue
                relative = os.path.relpath(entry.path, source)
                if target.endswith("/" + relative):
                    out.add(target[:-len(relative)] + relative.split("/")[0])
                else:
                    out.add(target)
            elif entry.is_dir(follow_symlinks=False):
                todo.append(entry.path)
    return sorted(out)


# --- projects ----------------------------------------------------------------------------------


def project_of(path, fallback):
    """The project folder ``path`` belongs to: the nearest folder at or above ``path``'s
    folder holding a project marker (at most `PROJECT_LEVELS` up), else ``fallback``."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    for _ in range(PROJECT_LEVELS):
        if folder in NEVER_A_PROJECT or any(under(folder, n) for n in NOT_A_PROJECT):
            break
        if any(os.path.lexists(os.path.join(folder, m)) for m in PROJECT_MARKERS):
            return folder
        folder = os.path.dirname(folder)
    return fallback


def a_project(path, installation):
    """May ``path`` be restricted or hidden as a project folder? Not ``/``, a system folder or
    part of the Python installation."""
    return (path and path not in NEVER_A_PROJECT and not any(under(path, n) for n in NOT_A_PROJECT)
            and not any(under(path, p) for p in installation))


def editable_installs(site_dirs, installation):
    """Read every ``.pth`` file of ``site_dirs``. Returns a dict: ``source_dirs`` (path lines:
    on the code's ``sys.path``, their importable entries shown), ``editable_paths`` (other
    paths to show: mapped packages and modules, link-tree targets), ``editable_modules``
    (``{name: [paths]}`` for the code's finder), ``editable_opaque`` (project folders of hooks
    not understood: hidden) and ``editable_unknown`` (those ``.pth`` files' names)."""
    sources, shown, modules, opaque, unknown = [], set(), {}, set(), []
    for directory in site_dirs:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            if not name.endswith(".pth"):
                continue
            paths, imports = read_pth(os.path.join(directory, name))
            sources += paths
            for folder in paths:
                if os.path.basename(folder).startswith("__editable__."):  # setuptools' strict-mode link tree
                    shown.update(link_targets(folder))
            understood = True
            for line in imports:
                tree = parse(line, name)
                texts = [line]
                for module in (imported_names(tree) if tree is not None else ()):
                    found = module_file(module, site_dirs)
                    if found is None:
                        continue
                    try:
                        if os.path.getsize(found) > MAX_HOOK_BYTES:
                            raise OSError("too large")
                        with open(found, encoding="utf-8", errors="replace") as f:
                            text = f.read()
                    except OSError:
                        understood = False
                        continue
                    module_tree = parse(text, found)
                    hook = hook_modules(module_tree) if module_tree is not None else None
                    if hook is None:
                        texts.append(text)
                        continue
                    for top, targets in hook.items():
                        modules.setdefault(top, [])
                        modules[top] += [t for t in targets if t not in modules[top]]
                        for target in targets:
                            shown.update(shown_files(target))
                outside = [p for p in set().union(*map(absolute_paths, texts))
                           if os.path.exists(p) and a_project(p, installation)]
                if tree is None or outside:
                    understood = False
                for path in outside:
                    root = project_of(path, path if os.path.isdir(path) else os.path.dirname(path))
                    if a_project(root, ()):
                        opaque.add(root)
            if not understood:
                unknown.append(name)
    real = lambda paths: sorted({os.path.realpath(p) for p in paths} - {"/"})  # noqa: E731
    return {"source_dirs": real(sources), "editable_paths": real(shown), "editable_modules": modules,
            "editable_opaque": real(opaque), "editable_unknown": unknown}


def project_roots(sources, shown, installation):
    """The project folders to empty in the code's view (the shown paths bound back): each
    source folder's project, and the project of each shown path's folder; never part of the
    installation (a project holding it, an in-project venv, keeps the venv bound back)."""
    roots = {project_of(s, s) for s in sources}
    roots.update(project_of(os.path.dirname(p), os.path.dirname(p)) for p in shown)
    return sorted(r for r in {os.path.realpath(r) for r in roots} if a_project(r, installation))
