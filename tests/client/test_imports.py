"""``pagoda_client`` and the ``pagoda`` command stay lean: grpcio and protobuf, no ML stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "numpy", "transformers", "matplotlib", "scheduler_svc", "executor_svc")


def _pagoda_command() -> list[str]:
    script = Path(sys.executable).parent / "pagoda"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pagoda_client.cli"]


def _imported(argv: list[str]) -> set[str]:
    """Top-level names of every module the command imported (Python's import-time report)."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "pagoda_client" in names  # the report is there, so an absent module really was not imported
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["chat", "--help"], ["status", "--help"]])
def test_pagoda_help_imports_no_heavy_module(args):
    assert _imported([*_pagoda_command(), *args]) & set(HEAVY) == set()


def test_importing_the_client_imports_no_heavy_module():
    imported = _imported([sys.executable, "-c", "import pagoda_client; pagoda_client.Client"])
    assert imported & set(HEAVY) == set()
    assert "pagoda_bench" not in imported  # the benchmark comes only with `pagoda bench`
