"""Editable installs, read from site-packages without running anything: what each makes
importable and which project folder it comes from.

Used by ``_sandbox_view.python_layout`` (host side, or the supervisor for another interpreter)
so that sandboxed code sees an editable install's importable code and nothing else of its
project. Kinds of ``.pth`` lines (a ``.start`` file's entry points, Python 3.15, read as the
``import`` lines they replace):

- a **path** line (hatchling, pdm, flit, setuptools' compat mode and its strict mode, whose
  path is a "link tree" ``build/__editable__.*`` of symlinks into the project): the folder goes
  on the code's ``sys.path``; only its importable entries are shown, and for a link tree the
  package folders its symlinks point into;
- an **import** line whose module is understood, each kind recognised by what its backend
  writes and read only where every value is a literal in the module's text:
  setuptools' finder (``__editable___<name>_finder.py``: ``MAPPING`` and ``NAMESPACES`` dicts,
  never changed after), the ``editables`` redirector (hatchling's and pdm's exact mode:
  ``F.map_module(name, path)`` calls), meson-python's loader (``_<name>_editable_loader.py``: a
  ``MesonpyMetaFinder(package, names, build_dir, ...)`` call; what it maps is the install plan
  meson wrote in the build folder, ``meson-info/intro-install_plan.json``, read as data) and
  scikit-build-core's (``_editable_skbc_<name>.py``: an ``install(known_source_files,
  known_wheel_files, known_directories, ...)`` call, or ``install_inplace(known_packages,
  search_paths, ...)`` whose search paths are path lines). A call's arguments are bound to the
  parameters of the ``def`` in the same file, so each backend's versions read alike. The
  modules are parsed (``compile(..., PyCF_ONLY_AST)``), never imported or run; the code's
  process gets equivalent finders (``_sandbox_code``). meson-python and scikit-build-core
  rebuild the project when their finder first imports it: inside, nothing rebuilds (the
  finders there only read files, on a read-only view): the code imports the sources as they
  are and the compiled modules of the last build made outside;
- an import line not understood (a hand-written hook; one of the kinds above whose values are
  computed when it runs: from a function call, a file, the environment): fail closed. Its
  projects are hidden whole: those of the absolute paths in its line and module that lie
  outside the installation and system folders, and the project pip recorded for the
  distribution that installed the ``.pth`` or the module (``direct_url.json``, PEP 610:
  ``{"url": "file:///project", "dir_info": {"editable": true}}``). A line that touches no
  part of the import system (``sys.path``, ``sys.meta_path``, path hooks, ``importlib``,
  ``exec``) and names no such path is no editable install and is left alone; one that does
  but whose project nothing records (a hand-written hook computing its paths, installed by
  no distribution) is listed in ``editable_unknown`` with nothing to hide: its paths cannot be
  told without running it.

Each shown path's project (the nearest folder above it holding ``pyproject.toml``,
``setup.py``, ``setup.cfg`` or ``.git``, at most four levels up) is emptied in the code's view
with only the shown paths bound back: its data, reward files and run folders do not exist there.
Standard library only, cheap imports only (no ``ast`` or ``json``: they import ``enum`` and
``re``; JSON goes through the C scanner ``json`` itself uses).
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


def read_start(path):
    """The entry points of a ``.start`` file (PEP 829, Python 3.15: ``module:callable`` lines,
    each called at start-up) as the ``import`` lines they stand for; an entry that is not a
    dotted name stays as it is, and is not understood."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = [line.strip() for line in f]
    except (OSError, UnicodeDecodeError):
        return ["?"]
    out = []
    for line in lines:
        if line and not line.startswith("#"):
            module, _, function = line.partition(":")
            names = [*module.split("."), *function.split(".")] if function else [""]
            out.append(f"import {module}; {module}.{function}()" if all(n.isidentifier() for n in names) else line)
    return out


# --- import hooks ------------------------------------------------------------------------------


def parse(source, filename):
    try:
        return compile(source, filename, "exec", PyCF_ONLY_AST, dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


def literal(node):
    """The value of a literal made of strings, numbers, booleans, None, lists, tuples, sets and
    dicts (else ``ValueError``): a value computed when the hook runs is not one."""
    kind = type(node).__name__
    if kind == "Constant" and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        return node.value
    if kind in ("List", "Tuple", "Set"):
        return [literal(e) for e in node.elts]
    if kind == "Dict" and None not in node.keys:
        return {literal(k): literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(kind)


def children(node):
    for name in getattr(node, "_fields", ()):
        value = getattr(node, name, None)
        if isinstance(value, list):
            yield from (v for v in value if hasattr(v, "_fields"))
        elif hasattr(value, "_fields"):
            yield value


def walk(node):
    """Every node under ``node`` (``ast.walk`` without importing ``ast``)."""
    todo = [node]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(children(node))


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
        elif literal_import(node):
            names.append(node.args[0].value.partition(".")[0])
    return names


def literal_import(node):
    return (type(node).__name__ == "Call" and type(node.func).__name__ == "Name" and node.func.id == "__import__"
            and node.args and type(node.args[0]).__name__ == "Constant" and isinstance(node.args[0].value, str))


IMPORT_SYSTEM = frozenset({"meta_path", "path_hooks", "path_importer_cache", "addsitedir", "__path__", "find_spec",
                           "find_module", "exec_module", "spec_from_file_location", "spec_from_loader",
                           "module_from_spec", "SourceFileLoader", "SourcelessFileLoader", "ExtensionFileLoader",
                           "import_module", "exec", "compile", "execfile", "run_path", "run_module"})
IMPORT_MODULES = frozenset({"importlib", "imp", "runpy", "site", "zipimport", "pkgutil"})


def touches_imports(tree):
    """Does this code change where modules come from: ``sys.path``, ``sys.modules``, the meta
    path and path hooks, ``importlib``, ``exec``, ``__import__`` of a computed name? A hook
    that computes its paths must reach one of them; a line that reaches none is no hook."""
    for node in walk(tree):
        kind = type(node).__name__
        if kind == "Name" and node.id in IMPORT_SYSTEM:
            return True
        if kind == "Attribute" and (node.attr in IMPORT_SYSTEM or (
                node.attr in ("path", "modules") and type(node.value).__name__ == "Name" and node.value.id == "sys")):
            return True
        if kind == "Import" and any(a.name.partition(".")[0] in IMPORT_MODULES for a in node.names):
            return True
        if kind == "ImportFrom" and ((node.module or "").partition(".")[0] in IMPORT_MODULES
                                     or any(a.name in IMPORT_SYSTEM or a.name in ("path", "modules")
                                            for a in node.names)):
            return True
        if (kind == "Call" and type(node.func).__name__ == "Name" and node.func.id == "__import__"
                and not literal_import(node)):
            return True
    return False


def module_file(name, site_dirs):
    for directory in site_dirs:
        for candidate in (os.path.join(directory, name + ".py"), os.path.join(directory, name, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def definitions(tree):
    """The module's top-level functions and classes by name."""
    return {node.name: node for node in tree.body if type(node).__name__ in ("FunctionDef", "ClassDef")}


def parameters(node):
    """``(positional, keyword-only)`` parameter names of a ``def`` (a class: of its ``__init__``,
    without ``self``); None for a class without one. Defaults are not read: what is read of a
    call is passed in it."""
    if type(node).__name__ == "ClassDef":
        init = next((n for n in node.body if type(n).__name__ == "FunctionDef" and n.name == "__init__"), None)
        return None if init is None else (parameters(init)[0][1:], parameters(init)[1])
    args = node.args
    return [a.arg for a in (*args.posonlyargs, *args.args)], [a.arg for a in args.kwonlyargs]


def bind(call, target):
    """The call's arguments by parameter name; None when an argument is not a literal (computed
    when the hook runs) or does not fit the ``def``."""
    signature = parameters(target)
    if signature is None or len(call.args) > len(signature[0]):
        return None
    names, bound = signature[0] + signature[1], {}
    try:
        for name, arg in zip(names, call.args):
            if type(arg).__name__ == "Starred":
                return None
            bound[name] = literal(arg)
        for keyword in call.keywords:
            if keyword.arg not in names:
                return None
            bound[keyword.arg] = literal(keyword.value)
    except ValueError:
        return None
    return bound


def calls(tree, names):
    """``(call, enclosing def)`` for every call of a plain name in ``names`` (enclosing: the
    innermost ``def`` around it, None at module level)."""
    out, todo = [], [(tree, None)]
    while todo:
        node, where = todo.pop()
        kind = type(node).__name__
        if kind in ("FunctionDef", "AsyncFunctionDef", "Lambda"):
            where = node
        elif kind == "Call" and type(node.func).__name__ == "Name" and node.func.id in names:
            out.append((node, where))
        todo.extend((child, where) for child in children(node))
    return out


def literal_calls(tree, names):
    """The bound arguments of each call of ``names`` (functions or classes defined in the
    module): all literal, or the enclosing one of ``names`` passing its own parameters on
    (``def install(names, path): Finder(names, path)``); None when any call is otherwise."""
    defined = definitions(tree)
    out = []
    for call, where in calls(tree, names):
        if call.func.id not in defined:
            return None
        if where is not None and getattr(where, "name", None) in names and type(where).__name__ == "FunctionDef":
            own = set(sum(parameters(where), []))
            values = [*call.args, *(k.value for k in call.keywords)]
            if values and all(type(v).__name__ == "Name" and v.id in own for v in values):
                continue
        bound = bind(call, defined[call.func.id])
        if bound is None:
            return None
        out.append(bound)
    return out


MAPPING_READS = frozenset({"items", "get", "keys", "values", "copy", "__contains__", "__getitem__"})


def setuptools_hook(tree):
    """setuptools' finder: ``{name: [path]}`` from its literal ``MAPPING`` (and top-level
    ``NAMESPACES``); None when they are not literals assigned once and never changed after."""
    values, assigned = {}, set()
    for node in tree.body:
        kind = type(node).__name__
        target = (node.target if kind == "AnnAssign"
                  else node.targets[0] if kind == "Assign" and len(node.targets) == 1 else None)
        if target is not None and type(target).__name__ == "Name" and target.id in ("MAPPING", "NAMESPACES"):
            if target.id in values or node.value is None:
                return None
            try:
                values[target.id] = literal(node.value)
            except ValueError:
                return None
            assigned.add(id(target))
    for node in walk(tree):  # changed after: assigned again, updated, aliased, declared global
        kind = type(node).__name__
        if kind == "Name" and node.id in values and type(node.ctx).__name__ != "Load" and id(node) not in assigned:
            return None
        if kind in ("Global", "Nonlocal") and set(node.names) & set(values):
            return None
        if kind in ("Subscript", "Attribute") and type(node.value).__name__ == "Name" and node.value.id in values:
            if type(node.ctx).__name__ != "Load" or (kind == "Attribute" and node.attr not in MAPPING_READS):
                return None
        if (kind in ("Assign", "AnnAssign", "NamedExpr") and type(node.value).__name__ == "Name"
                and node.value.id in values):
            return None
    mapping, namespaces = values.get("MAPPING"), values.get("NAMESPACES", {})
    if not (isinstance(mapping, dict) and isinstance(namespaces, dict)
            and all(isinstance(v, str) for v in mapping.values())):
        return None
    out = {k: [v] for k, v in mapping.items()}
    for name, paths in namespaces.items():  # top-level namespace packages only: nested ones import on their own
        if isinstance(name, str) and "." not in name and name not in out:
            if not (isinstance(paths, list) and all(isinstance(p, str) for p in paths)):
                return None
            out[name] = paths
    return out


def editables_hook(tree):
    """The ``editables`` redirector: ``{name: [paths]}`` from its ``F.map_module(name, path)``
    calls; None when one has an argument that is not a literal string."""
    out = {}
    for node in walk(tree):
        if type(node).__name__ == "Call" and getattr(node.func, "attr", None) == "map_module":
            try:
                if len(node.args) != 2 or node.keywords:
                    raise ValueError("arguments")
                name, path = literal(node.args[0]), literal(node.args[1])
            except ValueError:
                return None
            if not (isinstance(name, str) and isinstance(path, str)):
                return None
            if os.path.basename(path) == "__init__.py":
                path = os.path.dirname(path)
            if "." not in name and path not in out.get(name, ()):
                out.setdefault(name, []).append(path)
    return out


def mirrored(folder, package):
    """Is ``folder`` the source folder of ``package`` (its name)? Only then is it shown whole:
    a package whose ``__init__`` sits in the project's root must not show the project."""
    return os.path.isabs(folder) and os.path.basename(folder) == package.rpartition(".")[2]


def redirects_from_files(files):
    """meson's tree of installed files (``{(part, ...): source}``) as the modules it imports:
    ``{dotted name: [file or None, [folders] or None]}`` (a package's folders: its source
    folder when that mirrors it; a folder with no ``__init__`` is a namespace package), the
    file of a module found in meson's order: extension module, source, bytecode."""
    from importlib.machinery import BYTECODE_SUFFIXES, EXTENSION_SUFFIXES, SOURCE_SUFFIXES

    order = [*EXTENSION_SUFFIXES, *SOURCE_SUFFIXES, *BYTECODE_SUFFIXES]
    inits, modules, packages = {}, {}, set()
    for parts, source in files.items():
        packages.update(parts[:k] for k in range(1, len(parts)))
        for rank, suffix in enumerate(order):
            stem = parts[-1][:-len(suffix)]
            if parts[-1].endswith(suffix) and stem.isidentifier():
                found, key = (inits, parts[:-1]) if stem == "__init__" else (modules, (*parts[:-1], stem))
                if key not in found or found[key][0] > rank:
                    found[key] = (rank, source)
                break
    out = {}
    for key in (*modules, *packages, *inits):  # a package wins over a module, a module over a namespace
        if not all(p.isidentifier() for p in key):
            continue
        name = ".".join(key)
        if key in inits:
            folder = os.path.dirname(inits[key][1])
            out[name] = [inits[key][1], [folder] if mirrored(folder, name) else []]
        elif key in modules:
            out[name] = [modules[key][1], None]
        else:
            out[name] = [None, []]
    return out


def install_plan_files(build, names):
    """What meson-python's finder maps, as it reads it: the install plan meson wrote in the
    build folder, each file installed into site-packages (``{py_purelib}``, ``{py_platlib}``)
    under one of ``names`` by its parts, folders (``install_subdir``) walked; None when the plan
    is missing or not of that shape."""
    plan = read_json(os.path.join(build, "meson-info", "intro-install_plan.json"))
    if not isinstance(plan, dict):
        return None
    files = {}
    for key, entries in plan.items():
        if not isinstance(entries, dict):
            return None
        for source, target in entries.items():
            destination = target.get("destination") if isinstance(target, dict) else None
            if not (isinstance(destination, str) and os.path.isabs(source)):
                return None
            parts = tuple(p for p in destination.split("/") if p and p != ".")
            if len(parts) < 2 or parts[0] not in ("{py_purelib}", "{py_platlib}"):
                continue  # headers, scripts, data: not imported
            parts, source = parts[1:], os.path.normpath(source)
            if parts[0].partition(".")[0] not in names:
                continue
            if key == "install_subdirs" or (key == "targets" and os.path.isdir(source)):
                skip_files = {os.path.normpath(x) for x in target.get("exclude_files", ()) if isinstance(x, str)}
                skip_dirs = {os.path.normpath(x) for x in target.get("exclude_dirs", ()) if isinstance(x, str)}
                for relative in walk_files(source, skip_files, skip_dirs):
                    files[(*parts, *relative.split("/"))] = os.path.join(source, relative)
            else:
                files[parts] = source
            if len(files) > MAX_LINK_TREE_ENTRIES:
                return None
    return files


def walk_files(top, skip_files, skip_dirs):
    for root, folders, names in os.walk(top):
        folders[:] = sorted(f for f in folders if os.path.relpath(os.path.join(root, f), top) not in skip_dirs)
        for name in sorted(names):
            relative = os.path.relpath(os.path.join(root, name), top)
            if relative not in skip_files:
                yield relative


def meson_hook(tree):
    """meson-python's loader: ``{"redirects": ...}`` from the one literal
    ``MesonpyMetaFinder(package, names, path, cmd, verbose)`` (or, in older versions,
    ``install(names, path, cmd, verbose)``) call and the install plan in its build folder."""
    bound = literal_calls(tree, ("MesonpyMetaFinder", "install"))
    if not bound or len(bound) != 1:
        return None
    names, build = bound[0].get("names"), bound[0].get("path")
    if not (isinstance(names, list) and names and all(isinstance(n, str) and n.isidentifier() for n in names)
            and isinstance(build, str) and os.path.isabs(build)):
        return None
    files = install_plan_files(build, set(names))
    if not files:
        return None
    return {"redirects": redirects_from_files(files)}


def skbuild_hook(tree, site_dir):
    """scikit-build-core's: ``{"redirects": ...}`` from its literal ``install(...)`` call
    (the wheel's files relative to site-packages, the sources' absolute), or ``{"sources":
    [...]}`` from ``install_inplace(known_packages, search_paths, ...)``."""
    bound = literal_calls(tree, ("install", "install_inplace"))
    if not bound or len(bound) != 1:
        return None
    call = bound[0]
    if "search_paths" in call:  # inplace: imports come from these folders, as from path lines
        paths = call["search_paths"]
        if not (isinstance(paths, list) and paths and all(isinstance(p, str) and os.path.isabs(p) for p in paths)):
            return None
        return {"sources": paths}
    sources, wheel = call.get("known_source_files"), call.get("known_wheel_files")
    directories = call.get("known_directories") or {}
    if not (isinstance(sources, dict) and isinstance(wheel, dict) and isinstance(directories, dict)):
        return None
    files = {**{k: v for k, v in sources.items()}, **{k: os.path.join(site_dir, v) for k, v in wheel.items()
                                                     if isinstance(v, str)}}
    if not all(isinstance(k, str) and all(p.isidentifier() for p in k.split(".")) and isinstance(v, str)
               and os.path.isabs(v) for k, v in files.items()):
        return None
    folders = {}
    for package, paths in directories.items():
        if not (isinstance(package, str) and isinstance(paths, list) and all(isinstance(p, str) for p in paths)):
            return None
        folders[package] = [os.path.join(site_dir, p) for p in paths]  # the wheel's relative, the sources' not
    if not directories:  # older versions: a package's folders are those of its modules
        for name, path in files.items():
            package = name if os.path.basename(path).startswith("__init__.") else name.rpartition(".")[0]
            if package and os.path.dirname(path) not in folders.setdefault(package, []):
                folders[package].append(os.path.dirname(path))
    for package, paths in folders.items():  # a source folder that is not the package's own is not shown
        folders[package] = [p for p in paths if under(p, site_dir) or mirrored(p, package)]
    redirects = {}
    for name, path in files.items():
        package = os.path.basename(path).startswith("__init__.")
        redirects[name] = [path, folders.get(name, []) if package else None]
    for name, paths in folders.items():
        redirects.setdefault(name, [None, paths])
    return {"redirects": redirects}


def read_hook(tree, site_dir):
    """What one hook module maps, by the backend that wrote it: ``{"modules": {top-level name:
    [paths]}}`` (setuptools, ``editables``: found last, as theirs are), ``{"redirects": {dotted
    name: [file, folders]}}`` (meson-python, scikit-build-core: found first) or ``{"sources":
    [folders]}``; None when it is none of them, or maps nothing, or any value it maps is
    computed when it runs."""
    defined = definitions(tree)
    kinds = [kind for kind, seen in (
        ("meson", "MesonpyMetaFinder" in defined),
        ("skbuild", "ScikitBuildRedirectingFinder" in defined or "install_inplace" in defined),
        ("setuptools", any(type(n).__name__ in ("Assign", "AnnAssign") and "MAPPING" in
                           [getattr(t, "id", None) for t in (*getattr(n, "targets", ()), getattr(n, "target", None))]
                           for n in tree.body)),
        ("editables", any(getattr(getattr(n, "func", None), "attr", None) == "map_module" for n in walk(tree))),
    ) if seen]
    if len(kinds) != 1:
        return None
    if kinds[0] == "meson":
        return meson_hook(tree)
    if kinds[0] == "skbuild":
        return skbuild_hook(tree, site_dir)
    modules = setuptools_hook(tree) if kinds[0] == "setuptools" else editables_hook(tree)
    if not modules or not all(isinstance(k, str) and k.isidentifier() and v and all(os.path.isabs(p) for p in v)
                              for k, v in modules.items()):
        return None
    return {"modules": modules}


def shown_paths(hook):
    """What a hook's code must see: mapped folders and files (a module's path may lack its
    suffix, as setuptools writes it); of the redirects, each file and each package's folder."""
    out = []
    for paths in hook.get("modules", {}).values():
        for path in paths:
            out += shown_files(path)
    for file, folders in hook.get("redirects", {}).values():
        out += [p for p in (file, *(folders or ())) if p and os.path.lexists(p)]
    out = sorted(set(out))
    return [p for p in out if not any(q != p and under(p, q) for q in out)]


def read_json(path, limit=16 << 20):
    """A JSON file's value, or None (missing, too large, not JSON), through the C scanner
    ``json`` uses itself (importing ``json`` costs ~7 ms: ``re`` and ``enum``)."""
    try:
        if os.path.getsize(path) > limit:
            return None
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    try:
        from _json import make_scanner
    except ImportError:  # another Python: the module, then
        import json

        try:
            return json.loads(text)
        except ValueError:
            return None

    class Context:
        strict, object_hook, object_pairs_hook = True, None, None
        parse_float = parse_int = parse_constant = float

    start = len(text) - len(text.lstrip(" \t\n\r"))
    try:
        value, end = make_scanner(Context)(text, start)
    except (StopIteration, ValueError, RecursionError):
        return None
    return value if not text[end:].strip(" \t\n\r") else None


def unquote(text):
    """``%XX`` escapes of a ``file:`` URL decoded (``urllib.parse`` imports ``re``)."""
    head, *rest = text.split("%")
    out = bytearray(head.encode("utf-8", "surrogateescape"))
    for part in rest:
        if len(part) >= 2 and all(c in "0123456789abcdefABCDEF" for c in part[:2]):
            out.append(int(part[:2], 16))
            part = part[2:]
        else:
            out += b"%"
        out += part.encode("utf-8", "surrogateescape")
    return out.decode("utf-8", "surrogateescape")


def editable_projects(site_dirs):
    """``{path of a file in site-packages: project folder}`` for each distribution pip (or
    another installer) recorded as editable (``direct_url.json``, PEP 610) and each file its
    ``RECORD`` lists: the project a ``.pth`` file or hook module was installed for."""
    out = {}
    for directory in site_dirs:
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".dist-info"))
        except OSError:
            continue
        for name in names:
            info = read_json(os.path.join(directory, name, "direct_url.json"), 1 << 16)
            if not (isinstance(info, dict) and isinstance(info.get("dir_info"), dict)
                    and info["dir_info"].get("editable") is True and isinstance(info.get("url"), str)):
                continue
            url = info["url"]
            path = unquote(url[len("file://localhost"):] if url.startswith("file://localhost/")
                           else url[len("file://"):] if url.startswith("file:///") else "")
            if not os.path.isabs(path):
                continue
            try:
                with open(os.path.join(directory, name, "RECORD"), encoding="utf-8") as f:
                    record = f.read(1 << 20).splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            for line in record:
                entry = line.partition(",")[0].strip('"')
                if entry:
                    out[os.path.normpath(os.path.join(directory, entry))] = os.path.normpath(path)
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


def read_module(path):
    """A hook module's syntax tree and text, or None (unreadable, too large, not Python)."""
    try:
        if os.path.getsize(path) > MAX_HOOK_BYTES:
            return None
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    tree = parse(text, path)
    return None if tree is None else (tree, text)


def read_import_line(line, name, site_dirs):
    """One ``import`` line of a ``.pth`` file: ``(hooks, texts, files, hooklike)``: what the
    modules it imports from site-packages map (None when any is not understood, or the line
    passes them a value that is not a literal), the text of the line and of its modules (for
    the paths they name), the files involved, and whether it touches the import system at all
    (a line that does not is no hook)."""
    tree = parse(line, name)
    if tree is None:
        return None, [line], [], True
    hooks, texts, files, hooklike = [], [line], [], touches_imports(tree)
    for module in imported_names(tree):
        found = module_file(module, site_dirs)
        if found is None:  # the standard library, or nothing
            continue
        files.append(found)
        read = read_module(found)
        texts.append(read[1] if read else "")
        hook = read_hook(read[0], os.path.dirname(os.path.dirname(found)) if found.endswith("/__init__.py")
                         else os.path.dirname(found)) if read else None
        if hook is None:
            hooks = None
            hooklike = hooklike or read is None or touches_imports(read[0])
        elif hooks is not None:
            hooks.append(hook)
    if hooks:  # the line may only import its hooks and call them without computed arguments
        for node in walk(tree):
            if type(node).__name__ == "Call":
                try:
                    [literal(a) for a in (*node.args, *(k.value for k in node.keywords))]
                except ValueError:
                    hooks, hooklike = None, True
    return hooks or None, texts, files, hooklike


def editable_installs(site_dirs, installation):
    """Read every ``.pth`` file of ``site_dirs``. Returns a dict: ``source_dirs`` (path lines and
    in-place search paths: on the code's ``sys.path``, their importable entries shown),
    ``editable_paths`` (other paths to show: mapped packages, modules and files, link-tree
    targets), ``editable_modules`` (``{name: [paths]}`` for the code's finder, last on the meta
    path), ``editable_redirects`` (``{dotted name: [file, folders]}`` for the one first on it),
    ``editable_opaque`` (project folders of hooks not understood: hidden) and
    ``editable_unknown`` (those ``.pth`` files' names)."""
    sources, shown, modules, redirects, opaque, unknown = [], set(), {}, {}, set(), []
    recorded = None  # {file in site-packages: project}, read once, if a hook is not understood
    for directory in site_dirs:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            if not name.endswith((".pth", ".start")):
                continue
            pth = os.path.join(directory, name)
            paths, imports = read_pth(pth) if name.endswith(".pth") else ([], read_start(pth))
            sources += paths
            for folder in paths:
                if os.path.basename(folder).startswith("__editable__."):  # setuptools' strict-mode link tree
                    shown.update(link_targets(folder))
            understood = True
            for line in imports:
                hooks, texts, files, hooklike = read_import_line(line, name, site_dirs)
                for hook in hooks or ():
                    for top, targets in hook.get("modules", {}).items():
                        modules.setdefault(top, [])
                        modules[top] += [t for t in targets if t not in modules[top]]
                    for dotted, entry in hook.get("redirects", {}).items():
                        redirects.setdefault(dotted, entry)
                    sources += hook.get("sources", [])
                    shown.update(shown_paths(hook))
                if hooks is not None:
                    continue
                projects = {project_of(p, p if os.path.isdir(p) else os.path.dirname(p))
                            for p in set().union(*map(absolute_paths, texts))
                            if os.path.exists(p) and a_project(p, installation)}
                if recorded is None:
                    recorded = editable_projects(site_dirs)
                projects.update(recorded[f] for f in (pth, *files) if f in recorded)
                if hooklike or projects:  # an editable install's line not understood, or some hook's
                    understood = False
                    opaque.update(p for p in projects if os.path.isdir(p) and a_project(p, ()))
            if not understood:
                unknown.append(name)
    real = lambda paths: sorted({os.path.realpath(p) for p in paths} - {"/"})  # noqa: E731
    return {"source_dirs": real(sources), "editable_paths": real(shown), "editable_modules": modules,
            "editable_redirects": redirects, "editable_opaque": real(opaque), "editable_unknown": unknown}


def project_roots(sources, shown, installation):
    """The project folders to empty in the code's view (the shown paths bound back): each
    source folder's project, and the project of each shown path's folder; never part of the
    installation (a project holding it, an in-project venv, keeps the venv bound back)."""
    roots = {project_of(s, s) for s in sources}
    roots.update(project_of(os.path.dirname(p), os.path.dirname(p)) for p in shown)
    return sorted(r for r in {os.path.realpath(r) for r in roots} if a_project(r, installation))
