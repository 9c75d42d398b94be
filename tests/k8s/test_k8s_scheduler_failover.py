"""The rendered cpu overlay's two scheduler replicas over two executors, started locally from the manifests'
own flags (each scheduler's id from its pod name, as the downward API gives it): each replica drives one
executor, and when one replica is SIGKILLed its executor serves through the other within seconds."""

from __future__ import annotations

import signal

import pytest
from k8s_local import argv_and_env, main_container
from k8s_manifests import kubectl_path, overlay_dirs, render
from support.services import Service, wait_until
from support.tiny_model import build_tiny_model

from pagoda.launch.launcher import LOOPBACK, free_port
from pagoda_client import Client, PagodaError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(kubectl_path() is None, reason="kubectl (with kustomize) is not installed"),
]

POD_NAMES = ("pagoda-scheduler-5d8f7c9b4-k2x7q", "pagoda-scheduler-5d8f7c9b4-w9m4t")


def _local(port: int) -> dict[str, str]:
    return {"PAGODA_HOST": LOOPBACK, "PAGODA_PORT": str(port), "PAGODA_METRICS_PORT": str(free_port())}


def _executor(objects, model, tmp_path, index: int) -> Service:
    port = free_port()
    overrides = {
        **_local(port),
        "PAGODA_MODEL": str(model),
        "PAGODA_MODEL_CACHE_DIR": str(tmp_path / "cache"),
        "PAGODA_KV_CACHE_MEMORY": "4MiB",
        "PAGODA_KV_OFFLOAD_DIR": str(tmp_path / f"kv-offload-{index}"),
    }
    argv, env = argv_and_env(main_container(objects, "pagoda-executor"), objects, overrides)
    return Service(f"executor-{index}", argv, f"{LOOPBACK}:{port}", tmp_path / f"executor-{index}.log", env)


def _scheduler(objects, executors: list[Service], tmp_path, pod_name: str) -> Service:
    port = free_port()
    overrides = {
        **_local(port),
        "PAGODA_HTTP_PORT": str(free_port()),
        # In the cluster: the headless Service's name, which resolves to both executor pods.
        "PAGODA_EXECUTORS": ",".join(e.address for e in executors),
    }
    container = main_container(objects, "pagoda-scheduler")
    argv, env = argv_and_env(container, objects, overrides, pod={"metadata.name": pod_name})
    return Service(pod_name, argv, f"{LOOPBACK}:{port}", tmp_path / f"{pod_name}.log", env)


def _held(scheduler: Service) -> list[str]:
    """Holders of the executors this scheduler drives (READY), as its GetStatus reports them."""
    try:
        with Client(scheduler.address, timeout=5, max_retries=0) as client:
            return [e.lease_holder for e in client.status().executors if e.state == "READY"]
    except PagodaError:
        return []


def test_two_scheduler_replicas_fail_over(tmp_path):
    objects = render(overlay_dirs()["cpu"])
    deployment = main_container(objects, "pagoda-scheduler").workload
    assert deployment["spec"]["replicas"] == len(POD_NAMES)
    model = build_tiny_model(tmp_path / "models" / "tiny")
    executors = [_executor(objects, model, tmp_path, i) for i in range(2)]
    schedulers = [_scheduler(objects, executors, tmp_path, name) for name in POD_NAMES]
    try:
        for service in executors + schedulers:
            service.start()
        for service in executors + schedulers:
            service.wait_serving()
        wait_until(lambda: [_held(s) for s in schedulers] == [[n] for n in POD_NAMES], 30, "one executor each")

        schedulers[0].kill(signal.SIGKILL)
        took_s = wait_until(lambda: _held(schedulers[1]) == [POD_NAMES[1]] * 2, 10, "the survivor to hold both")
        print(f"replica SIGKILL -> the other holds both executors: {took_s:.2f}s")
        with Client(schedulers[1].address, timeout=60, max_retries=0) as client:
            result = client.generate(token_ids=[5, 6, 7, 8], max_tokens=5, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 5
    finally:
        for service in schedulers + executors:
            service.stop()
    assert [s.process.returncode for s in schedulers + executors] == [-signal.SIGKILL, 0, 0, 0]
