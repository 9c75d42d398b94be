"""``pagoda``'s plug-ins: found through the ``pagoda.cli`` entry points, never imported by the client itself.

The plug-ins of these tests are real installed distributions: a ``*.dist-info`` folder
with its ``entry_points.txt`` on ``PYTHONPATH``, as pip would leave it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from pagoda_client.cli_plugins import GROUP

CLIENT = Path(__file__).resolve().parents[2] / "client"
FORBIDDEN = "pagoda_bench"

HELLO = """
from pagoda_client.cli_plugins import CliPlugin


def add_arguments(parser):
    parser.add_argument("who")


def run(args):
    print(f"hello {args.who}, target={getattr(args, 'target', None)}")
    return 3


plugin = CliPlugin(help="says hello", add_arguments=add_arguments, run=run, connection=False)
"""

ENTRY_POINTS = """
[pagoda.cli]
hello = pagoda_test_hello:plugin
broken = pagoda_test_broken:plugin
odd = pagoda_test_hello:run
status = pagoda_test_hello:plugin
"""


def imports_of(source: str) -> list[str]:
    """Every module ``source`` imports, wherever the import is (functions, ``TYPE_CHECKING`` blocks), including
    ``importlib.import_module("...")`` and ``__import__("...")`` with a literal name."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.append(node.args[0].value)
    return names


def test_the_scan_finds_imports_in_functions_and_under_type_checking():
    source = textwrap.dedent(
        """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pagoda_bench.cli import plugin
        def f():
            import pagoda_bench.report as r
            return importlib.import_module("pagoda_bench.metrics"), __import__("pagoda_bench")
        """
    )
    found = [name for name in imports_of(source) if name.split(".")[0] == FORBIDDEN]
    assert found == ["pagoda_bench.cli", "pagoda_bench.report", "pagoda_bench.metrics", "pagoda_bench"]


def test_no_client_module_imports_the_benchmark():
    files = sorted(CLIENT.rglob("*.py"))
    assert len(files) > 10 and CLIENT / "cli.py" in files
    offenders = {
        str(path.relative_to(CLIENT)): name
        for path in files
        for name in imports_of(path.read_text())
        if name.split(".")[0] == FORBIDDEN
    }
    assert offenders == {}


def _pagoda(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "pagoda"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pagoda_client.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, env=env)


def test_pagoda_help_lists_bench_from_its_entry_point():
    names = {entry.name for entry in entry_points(group=GROUP)}
    assert "bench" in names, "the bench entry point is not registered: run make install"
    proc = _pagoda("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert "{generate,chat,models,status,serve,bench}" in proc.stdout
    assert "serving benchmark" in proc.stdout


@pytest.fixture
def installed(tmp_path) -> dict[str, str]:
    """The environment of a ``pagoda`` with three more plug-ins installed: one that works, one whose import fails,
    one that is not a plug-in, and one that takes a built-in command's name."""
    (tmp_path / "pagoda_test_hello.py").write_text(HELLO)
    (tmp_path / "pagoda_test_broken.py").write_text("raise ImportError('needs a package that is not installed')\n")
    dist_info = tmp_path / "pagoda_test_plugins-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: pagoda-test-plugins\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_a_plugin_that_cannot_be_used_is_reported_in_one_line_and_the_rest_works(installed):
    proc = _pagoda("--help", env=installed)
    assert proc.returncode == 0
    assert "{generate,chat,models,status,serve,bench,hello}" in proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 3, proc.stderr
    assert lines[0] == (
        "pagoda: plug-in 'broken' (pagoda_test_broken:plugin) left out: "
        "ImportError: needs a package that is not installed"
    )
    assert lines[1].startswith("pagoda: plug-in 'odd' (pagoda_test_hello:run) left out: function is not a ")
    assert lines[2] == "pagoda: plug-in 'status' (pagoda_test_hello:plugin) left out: the command exists already"


def test_a_plugin_runs_with_its_own_flags_and_exit_code(installed):
    proc = _pagoda("hello", "world", env=installed)
    assert (proc.returncode, proc.stdout) == (3, "hello world, target=None\n")  # connection=False: no --target
    assert "left out" in proc.stderr  # the broken ones are still named


def test_built_in_commands_load_no_plugin(installed):
    proc = _pagoda("status", "--help", env=installed)
    assert proc.returncode == 0 and proc.stderr == ""
    assert "--target" in proc.stdout


def test_bench_takes_the_connection_flags():
    proc = _pagoda("bench", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--target" in proc.stdout and "--num-prompts" in proc.stdout
