"""The flags and environment in the rendered manifests are real: start both
services locally exactly as the cpu overlay's containers would start, with
only addresses, ports and the model volume swapped for local ones."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from k8s_manifests import kubectl_path, overlay_dirs, render
from k8s_pods import container_env, containers
from support.tiny_model import build_tiny_model

from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.launcher import free_port, service_command
from pagoda_client import Client

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(kubectl_path() is None, reason="kubectl (with kustomize) is not installed"),
]


def _main_container(objects, program: str):
    return next(c for c in containers(objects) if not c.is_init and c.program == program)


def _argv_and_env(container, objects, overrides: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    command = container.spec.get("command") or []
    argv = service_command(
        command[0], {"pagoda-executor": "executor_svc.main", "pagoda-scheduler": "scheduler_svc.main"}[command[0]]
    )
    argv += list(command[1:]) + list(container.spec.get("args") or [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env.update(container_env(container, objects))
    env.update(overrides)
    return argv, env


def _wait_serving(address: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while check_health(address, timeout=1.0) != ServingStatus.SERVING:
        assert process.poll() is None, f"process exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{address} not SERVING"
        time.sleep(0.2)


def test_cpu_overlay_settings_start_real_services(tmp_path):
    objects = render(overlay_dirs()["cpu"])
    model = build_tiny_model(tmp_path / "models" / "tiny")
    executor_port, scheduler_port = free_port(), free_port()
    local = {"PAGODA_HOST": "127.0.0.1", "PAGODA_METRICS_PORT": str(free_port()), "PAGODA_HTTP_PORT": str(free_port())}
    ex_argv, ex_env = _argv_and_env(
        _main_container(objects, "pagoda-executor"),
        objects,
        {
            **local,
            "PAGODA_PORT": str(executor_port),
            "PAGODA_MODEL": str(model),
            "PAGODA_MODEL_CACHE_DIR": str(tmp_path / "cache"),
            "PAGODA_KV_CACHE_MEMORY": "4MiB",
        },
    )
    sc_argv, sc_env = _argv_and_env(
        _main_container(objects, "pagoda-scheduler"),
        objects,
        {
            **local,
            "PAGODA_METRICS_PORT": str(free_port()),
            "PAGODA_PORT": str(scheduler_port),
            "PAGODA_EXECUTORS": f"127.0.0.1:{executor_port}",
        },
    )
    processes = []
    try:
        with open(tmp_path / "executor.log", "wb") as ex_log, open(tmp_path / "scheduler.log", "wb") as sc_log:
            processes.append(subprocess.Popen(ex_argv, env=ex_env, stdout=ex_log, stderr=subprocess.STDOUT))
            _wait_serving(f"127.0.0.1:{executor_port}", processes[0])
            processes.append(subprocess.Popen(sc_argv, env=sc_env, stdout=sc_log, stderr=subprocess.STDOUT))
            _wait_serving(f"127.0.0.1:{scheduler_port}", processes[1])
            with Client(f"127.0.0.1:{scheduler_port}", timeout=60) as client:
                result = client.generate(token_ids=[5, 6, 7, 8], max_tokens=5, temperature=0, ignore_eos=True)
            assert len(result.token_ids) == 5
            assert check_health(f"127.0.0.1:{scheduler_port}", service="liveness") == ServingStatus.SERVING
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            assert process.wait(timeout=60) == 0
