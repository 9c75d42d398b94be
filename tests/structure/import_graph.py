"""The import graph of the project's packages, read from the source (every import: top level, inside functions,
under ``TYPE_CHECKING``), and its circles."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from support.installed import REPO, setup_script


def modules() -> dict[str, Path]:
    """Every module of the distribution's packages, by import name (``pkg.sub`` for ``pkg/sub/__init__.py``)."""
    setup = setup_script()
    found = {}
    for name, folder in setup.IMPORT_ROOTS.items():
        root = REPO / folder
        for path in root.rglob("*.py"):
            relative = path.relative_to(root).with_suffix("")
            if "csrc" in relative.parts:
                continue
            parts = [name, *relative.parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from pkg import sub` names the module pkg.sub when there is one (its package's __init__ is not counted:
            # a package that re-exports its modules is not a circle); `from mod import name` names mod.
            yield from (f"{base}.{alias.name}" for alias in node.names)


def graph() -> dict[str, set[str]]:
    """module -> the modules of the project it imports (a name that is not a module counts as its module)."""
    known = modules()
    edges: dict[str, set[str]] = {}
    for module, path in known.items():
        targets = set()
        for name in _imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        edges[module] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found
