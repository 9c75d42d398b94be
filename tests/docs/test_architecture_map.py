"""docs/architecture.md's request walk names real functions: every `file:function` it cites is defined there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAP = REPO / "docs" / "architecture.md"
_CITE_RE = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def citations(text: str) -> list[tuple[str, str]]:
    """(file, qualified name) of every `path.py:Name.attr` in `text`."""
    return _CITE_RE.findall(text)


def defined_names(path: Path) -> set[str]:
    """Qualified names of the functions and classes a module defines: `f`, `C`, `C.method`."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return names


def test_the_walk_has_about_twenty_hops():
    assert len(citations(MAP.read_text())) >= 20


@pytest.mark.parametrize(("file", "name"), citations(MAP.read_text()), ids=lambda x: x)
def test_every_cited_function_exists(file, name):
    path = REPO / file
    assert path.is_file(), f"docs/architecture.md cites {file}, which does not exist"
    assert name in defined_names(path), f"docs/architecture.md cites {file}:{name}, which is not defined there"


def test_the_check_sees_a_missing_function():
    assert "ModelRunner.execute" in defined_names(REPO / "executor_svc" / "runner" / "model_runner.py")
    assert "ModelRunner.no_such_method" not in defined_names(REPO / "executor_svc" / "runner" / "model_runner.py")
    assert citations("`a/b.py:C.f` and `c.py:g`") == [("a/b.py", "C.f"), ("c.py", "g")]
