"""Start the programs locally exactly as the rendered manifests' containers would, with only addresses,
ports, pod fields and the model volume swapped for local ones."""

from __future__ import annotations

import os
import subprocess
import time

from k8s_pods import Container, container_env, containers

from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.launcher import service_command

MODULES = {"pagoda-executor": "executor_svc.main", "pagoda-scheduler": "scheduler_svc.main"}


def main_container(objects: list[dict], program: str) -> Container:
    """The (non-init) container that runs `program`."""
    return next(c for c in containers(objects) if not c.is_init and c.program == program)


def argv_and_env(
    container: Container, objects: list[dict], overrides: dict[str, str], pod: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The container's command and args as a local argv, and its environment (pod fields from `pod`) plus overrides."""
    command = container.spec.get("command") or []
    argv = service_command(command[0], MODULES[command[0]])
    argv += list(command[1:]) + list(container.spec.get("args") or [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env.update(container_env(container, objects, pod))
    env.update(overrides)
    return argv, env


def wait_serving(address: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until `address` is SERVING (bounded); fails at once when the process exits."""
    deadline = time.monotonic() + timeout_s
    while check_health(address, timeout=1.0) != ServingStatus.SERVING:
        assert process.poll() is None, f"process exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{address} not SERVING"
        time.sleep(0.2)
