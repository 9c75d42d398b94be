"""What users install: the wheel built from a copy of the tree, installed non-editable into fresh venvs.

Each venv holds one extra of the distribution, as the images do (``.[scheduler]``,
``.[executor]``); no source folder is on its ``sys.path``. Every step is a
subprocess with a time bound, its output kept for the failure message.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 900


def setup_script() -> ModuleType:
    """The repository's setup.py as a module (its ``setup()`` runs only as a script)."""
    spec = importlib.util.spec_from_file_location("pagoda_setup", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(argv: list[str], timeout_s: float, cwd: Path | None = None) -> str:
    """Runs `argv`, failing with its output when it exits non-zero or outlives `timeout_s`."""
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (
        f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    return done.stdout


def copy_tree(dest: Path) -> Path:
    """The files git would commit (tracked, plus untracked ones not ignored) copied to `dest`: a clean checkout."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], 60, cwd=REPO)
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def build_wheel(workdir: Path) -> Path:
    """The ``pagoda`` wheel built from a clean copy of the tree (no build/ or egg-info of the checkout)."""
    source = copy_tree(workdir / "src")
    dist = workdir / "dist"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist)]
    run([*pip_wheel, str(source)], INSTALL_TIMEOUT_S)
    (wheel,) = dist.glob("pagoda-*.whl")
    return wheel


def make_venv(path: Path, requirements: list[str], no_deps: list[str] = ()) -> Path:
    """A fresh venv at `path` with `requirements` installed (and `no_deps` without their dependencies)."""
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    python = str(path / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements], INSTALL_TIMEOUT_S)
    if no_deps:
        run([python, "-m", "pip", "install", "-q", "--no-deps", *no_deps], INSTALL_TIMEOUT_S)
    return path


def pinned(distribution: str) -> str:
    """``name==version`` of `distribution` as installed in this (the test) environment: the pins the Makefile set."""
    return f"{distribution}=={importlib.metadata.version(distribution).split('+')[0]}"


# Imports every module under the given packages in an isolated interpreter (-I: no PYTHONPATH, no cwd on the
# path) and reports the failures, the files outside the venv, and whether torch or numpy got imported.
# Modules of the CUDA path: they import triton, which only CUDA builds of torch bring.
NEEDS_TRITON = {"executor_svc.attention.triton_backend", "executor_svc.models.triton_layer_ops"}

# Run by an installed interpreter with import roots as arguments: imports every module under them; prints a
# JSON report (modules, failures, modules imported from outside the interpreter's prefix).
IMPORT_ALL = """
import importlib, json, pkgutil, sys
failures, outside, modules = [], [], []
for root in sys.argv[1:]:
    package = importlib.import_module(root)
    found = pkgutil.walk_packages(package.__path__, root + ".", onerror=failures.append)
    for info in [None, *found]:
        name = root if info is None else info.name
        try:
            module = importlib.import_module(name)
        except Exception as error:
            failures.append(f"{name}: {error!r}")
            continue
        modules.append(name)
        if not module.__file__.startswith(sys.prefix):
            outside.append(f"{name}: {module.__file__}")
print(json.dumps({"modules": modules, "failures": failures, "outside": outside,
                  "torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules}))
"""


def import_everything(venv_dir: Path, roots: list[str], cwd: Path) -> dict:
    """Imports every module of `roots` in the venv's interpreter, from `cwd`; the report as a dict."""
    out = run([str(venv_dir / "bin" / "python"), "-I", "-c", IMPORT_ALL, *roots], 600, cwd=cwd)
    return json.loads(out.strip().splitlines()[-1])
