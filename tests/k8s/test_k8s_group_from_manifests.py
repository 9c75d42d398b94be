"""The group overlays' pods run locally on CPU, started from the rendered manifests with only addresses,
ports, the device and the model volume swapped for local ones.

gpu-group: a leader pod and a worker pod (the worker's own `sh -c` script run for real: it gives its rank and
its leader). The group of 4 x 2 ranks forms across the two "pods", a scheduler reaches it through the leader
alone, and when the worker pod is killed from outside the leader exits with the group-lost status, for the
kubelet to restart the group's pods. cpu-group: one pod is a whole group of 2 ranks and serves."""

from __future__ import annotations

import os
import signal

import pytest
from k8s_groups import launch, members
from k8s_local import argv_and_env, main_container
from k8s_manifests import kubectl_path, overlay_dirs, render
from support.services import Service, wait_until
from support.tiny_model import build_tiny_model

from executor_svc.parallel.collectives import GROUP_LOST_EXIT
from pagoda.launch.launcher import LOOPBACK, free_port, service_command
from pagoda_client import Client

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(kubectl_path() is None, reason="kubectl (with kustomize) is not installed"),
]

PODS = ("pagoda-executor-0", "pagoda-executor-worker-0")


def _local(tmp_path, api_port: int) -> dict[str, str]:
    """What this machine swaps: addresses, ports, the device and the model volume."""
    model = build_tiny_model(tmp_path / "models" / "tiny")  # 4 heads, 2 KV heads: T = 4 replicates the KV heads
    return {
        "PAGODA_HOST": LOOPBACK,
        "PAGODA_PORT": str(api_port),
        "PAGODA_METRICS_PORT": str(free_port()),
        "PAGODA_MODEL": str(model),
        "PAGODA_MODEL_CACHE_DIR": str(tmp_path / "cache"),
        "PAGODA_DEVICE": "cpu",
        "PAGODA_DTYPE": "float32",
        "PAGODA_KV_CACHE_MEMORY": "4MiB",
    }


def _scheduler(objects, tmp_path, executor: Service) -> Service:
    port = free_port()
    argv, env = argv_and_env(
        main_container(objects, "pagoda-scheduler"),
        objects,
        {
            "PAGODA_HOST": LOOPBACK,
            "PAGODA_PORT": str(port),
            "PAGODA_HTTP_PORT": str(free_port()),
            "PAGODA_METRICS_PORT": str(free_port()),
            "PAGODA_EXECUTORS": executor.address,  # in the cluster: the leaders' headless Service
        },
        pod={"metadata.name": "pagoda-scheduler-5d8f7c9b4-k2x7q"},
    )
    return Service("scheduler", argv, f"{LOOPBACK}:{port}", tmp_path / "scheduler.log", env)


def _generate(scheduler: Service) -> list[int]:
    with Client(scheduler.address, timeout=120, max_retries=0) as client:
        return client.generate(token_ids=[5, 6, 7, 8], max_tokens=5, temperature=0, ignore_eos=True).token_ids


def _pod_services(objects, tmp_path) -> list[Service]:
    """The leader and worker pods of group 0, each as the process its container starts."""
    api_port, rendezvous = free_port(), f"{LOOPBACK}:{free_port()}"  # in the cluster: pagoda-executor-0.pagoda-...
    local = _local(tmp_path, api_port) | {"PAGODA_GROUP_ADDRESS": rendezvous}
    pods = {m.pod_name: m for m in members(objects)[0]}
    leader_address = pods[PODS[0]].own_address()
    services = []
    for name in PODS:
        member = pods[name]
        args, env = launch(member.container, objects, {"metadata.name": name, "metadata.namespace": "pagoda"})
        assert env["PAGODA_GROUP_ADDRESS"] == leader_address
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")} | env | local
        argv = service_command("pagoda-executor", "executor_svc.main") + args
        services.append(Service(name, argv, f"{LOOPBACK}:{api_port}", tmp_path / f"{name}.log", env))
    return services


def test_gpu_group_pods_serve_as_one_executor_and_fall_together(tmp_path):
    objects = render(overlay_dirs()["gpu-group"])
    leader, worker = _pod_services(objects, tmp_path)
    scheduler = _scheduler(objects, tmp_path, leader)
    try:
        worker.start()
        leader.start()
        leader.wait_serving(timeout_s=300)
        (formed,) = leader.events("group_formed")
        assert formed["world_size"] == 8
        scheduler.start().wait_serving()
        assert len(_generate(scheduler)) == 5

        worker.kill(signal.SIGKILL)  # the worker pod's processes, as a node loss or an OOM kill would end them
        took_s = wait_until(lambda: not leader.alive, 60, "the leader to exit")
        print(f"worker pod SIGKILL -> leader exited in {took_s:.2f}s")
        assert leader.process.returncode == GROUP_LOST_EXIT
    finally:
        for service in (scheduler, leader, worker):
            service.stop()


def test_a_cpu_group_pod_serves_as_one_executor(tmp_path):
    objects = render(overlay_dirs()["cpu-group"])
    api_port = free_port()
    argv, env = argv_and_env(main_container(objects, "pagoda-executor"), objects, _local(tmp_path, api_port))
    executor = Service("executor", argv, f"{LOOPBACK}:{api_port}", tmp_path / "executor.log", env)
    scheduler = _scheduler(objects, tmp_path, executor)
    try:
        executor.start().wait_serving(timeout_s=300)
        (formed,) = executor.events("group_formed")
        assert formed["world_size"] == 2
        scheduler.start().wait_serving()
        assert len(_generate(scheduler)) == 5
    finally:
        for service in (scheduler, executor):
            service.stop()
    assert [scheduler.process.returncode, executor.process.returncode] == [0, 0]
