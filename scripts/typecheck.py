"""Run mypy --strict over the pure-Python packages (``make lint``).

The client's installed name differs from its folder (``pagoda_client`` is
``client/``), so mypy reads it through a link under ``build/typecheck`` that
carries the installed name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKS = {"pagoda_client": ROOT / "client"}
# Strict packages: the scheduler, the client and the shared pure-Python modules.
PACKAGES = (
    "scheduler_svc",
    "pagoda_client",
    "pagoda.runtime",
    "pagoda.by_name",
    "pagoda.params",
    "pagoda.params_pb",
    "pagoda.step",
    "pagoda.step_pb",
    "pagoda.constraint",
    "pagoda.constraint_pb",
    "pagoda.grammar",
    "pagoda.channel",
    "pagoda.tracing",
    "pagoda.launch",
    "executor_svc.serving.lease",
    "executor_svc.config",
)


def link_tree() -> Path:
    """``build/typecheck/<name>`` -> the package's folder, for each renamed package."""
    tree = ROOT / "build" / "typecheck"
    tree.mkdir(parents=True, exist_ok=True)
    for name, target in LINKS.items():
        link = tree / name
        if link.is_symlink() and link.resolve() == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    return tree


def main() -> int:
    tree = link_tree()
    env = {**os.environ, "MYPYPATH": os.pathsep.join([str(tree), str(ROOT)])}
    args = [sys.executable, "-m", "mypy", "--strict"]
    for package in PACKAGES:
        args += ["-p", package]
    return subprocess.call(args, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
