"""YAML as options are given: ``--config`` files, ``KEY=VALUE`` values and mappings given as text.

PyYAML's safe loader (plain data only: a ``!!python/object`` tag is refused, nothing runs), with at
most `MAX_ALIASES` aliases (``*name``) in one document and at most `MAX_NODES` values once every
alias is written out: a file of nested aliases, a "billion laughs", expands to gigabytes once
anything walks it, and is refused as it is read instead (a config file has no need for more than
a few aliases); so is a value that contains itself, and values nested more than `MAX_DEPTH`
levels deep (PyYAML composes recursively: a few thousand levels were a RecursionError). Every error is one `ConfigError` line naming
the place.
"""

from __future__ import annotations

from typing import Any

from rlhf.core.errors import ConfigError

MAX_ALIASES = 64
MAX_NODES = 100_000
MAX_DEPTH = 100  # levels of nesting (a deeper file made the loader recurse out of Python's stack)


def load_yaml(text: str, where: str) -> Any:
    """The data of the YAML ``text``; ``where`` names it in the error (a file, a flag)."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        aliases = 0

        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise yaml.MarkedYAMLError(problem=f"values nested more than {MAX_DEPTH} levels deep",
                                               problem_mark=self.peek_event().start_mark)
                return self._compose_counted(parent, index)
            finally:
                self.depth -= 1

        def _compose_counted(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_ALIASES:
                    raise yaml.MarkedYAMLError(problem=f"more than {MAX_ALIASES} aliases (a file of nested "
                                                       "aliases expands without bound; write the values out)",
                                               problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)

        def compose_document(self) -> Any:
            node = super().compose_document()
            size = _expanded(node, {})
            if size > MAX_NODES:
                problem = ("a value contains itself (through an alias)" if size == float("inf") else
                           f"more than {MAX_NODES:,} values once its aliases are written out (nested aliases); "
                           "write the values out")
                raise yaml.MarkedYAMLError(problem=problem, problem_mark=node.start_mark)
            return node

    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader, bounded
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: {describe(exc)}") from None
    except RecursionError:  # the scanner's own nesting, before a node is composed
        raise ConfigError(f"{where}: values nested too deep to read (more than {MAX_DEPTH} levels)") from None


def describe(exc: Exception) -> str:
    """A YAML error in one line: what is wrong, and where (PyYAML's own message spans several)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    text = f"{context} {problem}" if context else problem
    return " ".join(text.split()) + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark else "")


def _expanded(node: Any, sizes: dict[int, float]) -> float:
    """How many nodes ``node`` stands for with every alias written out (infinite for a node that
    contains itself); ``sizes`` memoizes shared nodes, so this costs the size of the file."""
    import yaml

    key = id(node)
    if key in sizes:
        return sizes[key]
    sizes[key] = float("inf")  # until known: a node met again inside itself never ends
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded(k, sizes) + _expanded(v, sizes) for k, v in node.value)
    else:
        size = 1
    sizes[key] = size
    return size
