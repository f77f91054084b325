"""What sandboxed code may see of the host's files, planned before anything is mounted.

Used by ``_sandbox_mounts.py`` (which carries the plan out inside the mount namespace) and by the
host (``python_layout``, computed once per interpreter). Standard library only; of its siblings
only ``_sandbox_editable.py`` (what editable installs make importable).

Three kinds of paths:

- **visible**: the Python installation (prefixes, site-packages, what site-packages link to) and
  what editable installs make importable (``_sandbox_editable.py``): of each directory a path
  ``.pth`` line names (hatchling, pdm, flit, setuptools' compat mode) only its importable entries
  (packages, modules, extension modules, ``*.dist-info``/``*.egg-info`` metadata, ``*.libs``),
  the package folders a link tree (setuptools' strict mode) points into, the packages an import
  hook maps (setuptools' finder, ``editables``, meson-python, scikit-build-core): never the
  project's data, reward files or run directories;
- **emptied**: an empty tmpfs over the path, the visible paths below it bound back read-only
  (home directories, directories the sandbox uid could not cross, the private ``/tmp``, each
  editable install's directory and project folder, and a hidden directory that holds something
  visible);
- **gone**: a hidden path with nothing visible below it does not exist inside. Its parent is
  replaced by a tmpfs holding the parent's other entries (bound back, symlinks re-made), so the
  hidden name appears nowhere, ``/proc/self/mountinfo`` included; directly under ``/`` (no parent
  to rebuild) or in a parent of more than 512 entries, a directory is emptied to an unreadable
  tmpfs and a file covered by an unreadable one (a read fails, but a mount names the path).

Operations run shallowest first: a deeper one acts on what a shallower one bound back.
"""

import os

if __package__:  # rlhf.sandbox on the host; a top-level sibling in the supervisor (python -I -S)
    from ._sandbox_editable import editable_installs, project_roots
else:
    from _sandbox_editable import editable_installs, project_roots

TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # all the same private tmpfs inside
METADATA_SUFFIXES = (".dist-info", ".egg-info", ".libs")
MODULE_SUFFIXES = (".py", ".so", ".pyd")
SYSTEM_DIRS = frozenset({"/bin", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt", "/sbin", "/srv", "/usr",
                         "/usr/bin", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/local", "/usr/local/lib",
                         "/usr/share", "/var", "/var/lib"})  # never an editable install's project folder


def under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


def closed_ancestors(path, uid):
    """The directories on the way to ``path`` that ``uid`` cannot cross (to mask)."""
    out = []
    parts = path.rstrip("/").split("/")
    for i in range(2, len(parts)):
        d = "/".join(parts[:i])
        try:
            st = os.stat(d)
        except OSError:
            continue
        if not (st.st_mode & 0o001 or (st.st_uid == uid and st.st_mode & 0o100)):
            out.append(d)
    return out


# --- the Python installation and editable installs --------------------------------------------


def python_layout(sys):
    """This interpreter's installation (``python_paths``, kept visible), its site-packages
    (``site_dirs``, put on the code's ``sys.path``) and its editable installs
    (``_sandbox_editable.editable_installs``: ``source_dirs`` also go on ``sys.path``, of each
    only the importable entries are visible; ``editable_paths`` visible, ``editable_modules``
    found by the code's finder; ``editable_roots``, their projects, emptied around them;
    ``editable_opaque``, the projects of hooks not understood, hidden).

    Run with ``-S``, a venv's interpreter still has the base installation's ``sys.prefix``: its
    own prefix is the directory of the ``pyvenv.cfg`` next to (or above) the executable.
    """
    import site

    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    site_prefixes = [sys.prefix]
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    for venv in (exe_dir, os.path.dirname(exe_dir)):
        if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
            prefixes.append(venv)
            with open(os.path.join(venv, "pyvenv.cfg")) as f:
                system = any(line.replace(" ", "").lower().startswith("include-system-site-packages=true")
                             for line in f)
            site_prefixes = [venv, sys.base_prefix] if system else [venv]
            break
    site_dirs = [d for d in site.getsitepackages(site_prefixes) if os.path.isdir(d)]
    links = linked_elsewhere(site_dirs)
    paths = sorted({os.path.realpath(p) for p in (*prefixes, *site_dirs, *links)})
    paths = [p for p in paths if not any(p != q and under(p, q) for q in paths)]
    editable = editable_installs(site_dirs, paths)
    restricted = [s for s in editable["source_dirs"] if restrictable(s, paths)]
    editable["editable_roots"] = project_roots(restricted, editable["editable_paths"], paths)
    return {"python_paths": paths, "site_dirs": site_dirs, **editable}


def restrictable(source, keep):
    """Is ``source`` (a folder a ``.pth`` file names) a project's, to show only its importable
    entries? Not inside the installation (shown whole already), not holding it, not a system
    folder (a ``.pth`` naming /usr/lib, say): restricting those would hide libraries."""
    return source not in SYSTEM_DIRS and not any(under(source, k) or under(k, source) for k in keep)


def linked_elsewhere(site_dirs):
    """What site-packages reach outside themselves through symlinked entries (a package linked
    from another environment): part of the installation."""
    links = []
    for directory in site_dirs:
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        for name in entries:
            path = os.path.join(directory, name)
            if os.path.islink(path) and os.path.exists(path):
                links.append(path)
    return links


def importable_entries(directory):
    """The entries of ``directory`` Python imports or needs to: packages (a folder holding
    ``__init__.py``, modules or such folders: namespace packages too), modules and extension
    modules, distribution metadata and vendored libraries. Not data, run folders or dotfiles."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return []
    out = []
    for entry in entries:
        name = entry.name
        if name.startswith("."):
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if is_dir and (name.endswith(METADATA_SUFFIXES) or (name.isidentifier() and holds_code(entry.path, 3))):
            out.append(entry.path)
        elif not is_dir and name.endswith(MODULE_SUFFIXES) and name.partition(".")[0].isidentifier():
            out.append(entry.path)
    return out


def holds_code(directory, depth):
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return False
    for entry in entries:
        try:
            if entry.is_file() and entry.name.endswith(MODULE_SUFFIXES):  # a link tree's symlinks too
                return True
        except OSError:
            continue
    return depth > 1 and any(e.name.isidentifier() and e.is_dir(follow_symlinks=False) and holds_code(e.path, depth - 1)
                             for e in entries)


# --- the plan ----------------------------------------------------------------------------------


def depth(path):
    return 0 if path == "/" else path.count("/")


def ancestors(path):
    """The strict ancestors of ``path``, deepest first."""
    while path != "/":
        path = os.path.dirname(path)
        yield path


def innermost(path, marks):
    """The deepest strict ancestor of ``path`` in ``marks`` (None: none is)."""
    return next((above for above in ancestors(path) if above in marks), None)


def plan(keep, sources, masked, hidden, uid, shown=(), roots=()):
    """The operations that build the view, shallowest first, and what each hidden path became.

    ``keep``: the installation (directories); ``sources``: editable-install directories (path
    ``.pth`` lines); ``masked``: directories to empty (home directories); ``hidden``: files and
    directories that must not be readable; ``uid``: the code's uid (None: ours); ``shown``: other
    paths editable installs import from (visible); ``roots``: their project folders (emptied,
    the visible paths in them bound back). Returns ``(ops, visible)`` where an
    op is ``("tmp", "/tmp", reexpose)`` (the private, writable one), ``("tmpbind", path, reexpose)``
    (``/var/tmp`` and the like: the same), ``("empty", path, reexpose)``, ``("prune", parent,
    names)`` or ``("blank", path, None)``; ``reexpose`` lists the visible paths to bind back.
    """
    keep = [p for p in keep if os.path.isdir(p)]
    hidden = [h for h in hidden if h != "/" and os.path.lexists(h)]
    # a .pth folder inside the installation is shown whole already; one holding it, or a system
    # folder (a .pth naming /usr/lib, say), is no project: restricting it would hide libraries
    sources = [s for s in sources if os.path.isdir(s) and restrictable(s, keep)]
    visible = list(keep)
    for source in sources:  # of an editable install only what Python imports, and nothing hidden inside it
        visible += [e for e in importable_entries(source)
                    if not any(under(e, h) and not under(source, h) for h in hidden)]
    visible += [p for p in shown if os.path.lexists(p) and p not in hidden and not any(under(p, k) for k in keep)]
    marks = {v: "visible" for v in visible}
    empty = {m for m in masked if os.path.isdir(m) and m != "/"}
    if uid is not None:  # directories the unprivileged uid could not cross on the way to what it must see
        for v in visible:
            empty.update(closed_ancestors(v, uid))
    empty = {m for m in empty if not any(under(m, k) for k in keep)}
    empty.update(sources)
    empty.update(r for r in roots if os.path.isdir(r) and r not in SYSTEM_DIRS and not any(under(r, k) for k in keep))
    empty.update(h for h in hidden if any(v != h and under(v, h) for v in visible))
    for path in empty - set(visible):
        marks[path] = "empty"
    for path in TMP_DIRS:
        marks[path] = "tmp"
    for h in hidden:
        marks.setdefault(h, "gone")

    def shown(path):  # would this path be visible, before its own operation?
        above = innermost(path, marks)
        return above is None or marks[above] == "visible"

    ops = [("tmp", "/tmp", None), *(("tmpbind", p, None) for p in TMP_DIRS[1:])]
    for path, kind in marks.items():
        if kind == "empty" and shown(path):
            ops.append(("empty", path, None))
    prune = {}
    for h in hidden:
        if marks[h] != "gone" or not shown(h):
            continue
        parent = os.path.dirname(h)
        if parent == "/":
            ops.append(("blank", h, None))
        else:
            prune.setdefault(parent, set()).add(os.path.basename(h))
    ops += [("prune", parent, sorted(names)) for parent, names in prune.items()]
    ops.sort(key=lambda op: (depth(op[1]), op[0] != "tmp", op[1]))
    emptied = {path for kind, path, _ in ops if kind in ("tmp", "tmpbind", "empty")}
    again = {}  # what to bind back under each emptied path: the visible paths it covers
    for v in visible:
        for above in ancestors(v):
            if above in emptied:
                again.setdefault(above, []).append(v)
                break
            if marks.get(above) == "visible":  # shown with it
                break
    ops = [(kind, path, sorted(again.get(path, ()))) if kind in ("tmp", "tmpbind", "empty") else (kind, path, arg)
           for kind, path, arg in ops]
    return ops, visible
