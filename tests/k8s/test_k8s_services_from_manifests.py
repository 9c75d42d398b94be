"""The flags and environment in the rendered manifests are real: start both
services locally exactly as the cpu overlay's containers would start, with
only addresses, ports and the model volume swapped for local ones."""

from __future__ import annotations

import subprocess

import pytest
from k8s_local import argv_and_env, main_container, wait_serving
from k8s_manifests import kubectl_path, overlay_dirs, render
from support.tiny_model import build_tiny_model

from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.launcher import free_port
from pagoda_client import Client

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(kubectl_path() is None, reason="kubectl (with kustomize) is not installed"),
]


def test_cpu_overlay_settings_start_real_services(tmp_path):
    objects = render(overlay_dirs()["cpu"])
    model = build_tiny_model(tmp_path / "models" / "tiny")
    executor_port, scheduler_port = free_port(), free_port()
    local = {"PAGODA_HOST": "127.0.0.1", "PAGODA_METRICS_PORT": str(free_port()), "PAGODA_HTTP_PORT": str(free_port())}
    ex_argv, ex_env = argv_and_env(
        main_container(objects, "pagoda-executor"),
        objects,
        {
            **local,
            "PAGODA_PORT": str(executor_port),
            "PAGODA_MODEL": str(model),
            "PAGODA_MODEL_CACHE_DIR": str(tmp_path / "cache"),
            "PAGODA_KV_CACHE_MEMORY": "4MiB",
            "PAGODA_KV_OFFLOAD_DIR": str(tmp_path / "kv-offload"),
        },
    )
    sc_argv, sc_env = argv_and_env(
        main_container(objects, "pagoda-scheduler"),
        objects,
        {
            **local,
            "PAGODA_METRICS_PORT": str(free_port()),
            "PAGODA_PORT": str(scheduler_port),
            "PAGODA_EXECUTORS": f"127.0.0.1:{executor_port}",
        },
        pod={"metadata.name": "pagoda-scheduler-5d8f7c9b4-x2x7q"},
    )
    processes = []
    try:
        with open(tmp_path / "executor.log", "wb") as ex_log, open(tmp_path / "scheduler.log", "wb") as sc_log:
            processes.append(subprocess.Popen(ex_argv, env=ex_env, stdout=ex_log, stderr=subprocess.STDOUT))
            wait_serving(f"127.0.0.1:{executor_port}", processes[0])
            processes.append(subprocess.Popen(sc_argv, env=sc_env, stdout=sc_log, stderr=subprocess.STDOUT))
            wait_serving(f"127.0.0.1:{scheduler_port}", processes[1])
            with Client(f"127.0.0.1:{scheduler_port}", timeout=60) as client:
                result = client.generate(token_ids=[5, 6, 7, 8], max_tokens=5, temperature=0, ignore_eos=True)
            assert len(result.token_ids) == 5
            assert check_health(f"127.0.0.1:{scheduler_port}", service="liveness") == ServingStatus.SERVING
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            assert process.wait(timeout=60) == 0
