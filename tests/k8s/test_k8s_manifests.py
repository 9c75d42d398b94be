"""k8s/ renders, validates strictly against the Kubernetes schemas, and is
consistent with itself and with the programs' real flags (offline, no cluster)."""

from __future__ import annotations

import k8s_validate as validate
import pytest
from k8s_checks import check_all, check_images_across
from k8s_flags import docs_flags, parser_flags, program_flags
from k8s_manifests import KUBE_VERSION, kubectl_path, overlay_dirs, render, validate_schemas
from k8s_pods import container_env, containers, setting

pytestmark = pytest.mark.skipif(kubectl_path() is None, reason="kubectl is not installed: k8s/ cannot be rendered")

OVERLAYS = sorted(overlay_dirs())
CHECKS = [
    "selectors",
    "target_ports",
    "executor_address",
    "probes",
    "config_refs",
    "env_flags",
    "drain",
    "security",
    "metrics",
    "resources",
    "scheduler_replicas",
    "groups",
]
# Overlays whose executors are groups of ranks (docs/parallel-deploy.md).
GROUP_OVERLAYS = ["cpu-group", "gpu-group"]


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict]]:
    return {name: render(path) for name, path in overlay_dirs().items()}


@pytest.fixture(scope="module")
def flags():
    return validate.known_flags()[:2]


def _container(objects, program):
    return next(c for c in containers(objects) if c.program == program)


def test_every_kustomization_is_rendered():
    assert OVERLAYS == ["base", "cpu", "cpu-group", "gpu", "gpu-group", "gpu-tls"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_schema_strict(renders, overlay):
    kinds = sorted({o["kind"] for o in renders[overlay]})
    assert kinds == ["ConfigMap", "Deployment", "Namespace", "PodDisruptionBudget", "Service", "StatefulSet"]
    assert validate_schemas(renders[overlay], KUBE_VERSION) == []


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_consistency(renders, flags, overlay, check):
    results = check_all(renders[overlay], *flags)
    assert sorted(results) == sorted(CHECKS)
    assert results[check] == []


def test_images_agree_across_overlays(renders):
    assert check_images_across(renders, validate.project_version()) == []
    images = {name: {c.name: c.spec["image"] for c in containers(objs)} for name, objs in renders.items()}
    assert images["cpu"]["executor"] == "ghcr.io/pagoda-llm/pagoda-executor:0.1.0-cpu"
    assert (
        images["gpu"]["executor"] == images["gpu-tls"]["model-init"] == "ghcr.io/pagoda-llm/pagoda-executor:0.1.0-cuda"
    )
    assert {images[o]["scheduler"] for o in OVERLAYS} == {"ghcr.io/pagoda-llm/pagoda-scheduler:0.1.0"}


@pytest.mark.parametrize("program,flag", [("pagoda-executor", "--model"), ("pagoda-scheduler", "--executors")])
def test_flags_come_from_the_real_parser_when_it_exists(program, flag):
    flags, source = program_flags(program)
    real = parser_flags(program)
    assert flags == (real or docs_flags(program))
    assert source.endswith(".config") == bool(real)
    assert flag in flags and "--help" not in flags


def test_rendered_settings(renders):
    for overlay, objects in renders.items():
        assert {o["metadata"].get("namespace", "pagoda") for o in objects} == {"pagoda"}, overlay
        sched = _container(objects, "pagoda-scheduler")
        assert setting(sched, objects, "--executors") == "pagoda-executor.pagoda.svc.cluster.local:50061"
        assert setting(sched, objects, "--http-port") == "8000"
    cpu, gpu = _container(renders["cpu"], "pagoda-executor"), _container(renders["gpu"], "pagoda-executor")
    assert setting(cpu, renders["cpu"], "--device") == "cpu"
    assert setting(cpu, renders["cpu"], "--num-threads") == cpu.spec["resources"]["limits"]["cpu"] == "4"
    assert setting(gpu, renders["gpu"], "--device") == "cuda"
    assert gpu.spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    init = next(c for c in containers(renders["cpu"]) if c.is_init)
    assert container_env(init, renders["cpu"]) == {"PAGODA_MODEL": "default", "PAGODA_CACHE_DIR": "/models/cache"}


def test_tls_overlay_passes_flags_and_mounts_secrets(renders):
    objects = renders["gpu-tls"]
    executor, sched = _container(objects, "pagoda-executor"), _container(objects, "pagoda-scheduler")
    assert executor.arg_flags() == {
        "--tls-cert": "/etc/pagoda/tls/tls.crt",
        "--tls-key": "/etc/pagoda/tls/tls.key",
        "--tls-ca": "/etc/pagoda/tls/ca.crt",
    }
    assert sorted(sched.arg_flags()) == [
        "--executor-tls-ca",
        "--executor-tls-cert",
        "--executor-tls-key",
        "--tls-cert",
        "--tls-key",
    ]
    secrets = sorted(
        v["secret"]["secretName"]
        for c in (executor, sched)
        for v in c.workload["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    )
    assert secrets == ["pagoda-executor-tls", "pagoda-scheduler-client-tls", "pagoda-scheduler-tls"]
    assert not [o for o in objects if o["kind"] == "Secret"]


def test_make_target_script_passes(capsys):
    assert validate.main([]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{len(OVERLAYS) * (len(CHECKS) + 1) + 1} checks, 0 errors"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_programs_parse_the_rendered_settings(renders, overlay):
    """Each main container that serves its API parses its args and environment with the program's own
    config loader (values such as `2GiB` or `json` included), giving what the manifests say. (The other
    ranks of executor groups: test_k8s_groups.py.)"""
    parse_config = pytest.importorskip("pagoda.runtime.flags").parse_config
    classes = {
        "pagoda-executor": ("executor_svc.config", "ExecutorConfig"),
        "pagoda-scheduler": ("scheduler_svc.config", "SchedulerServiceConfig"),
    }
    for c in containers(renders[overlay]):
        if not c.program or not c.port("grpc"):
            continue
        module = pytest.importorskip(classes[c.program][0])
        config_cls = getattr(module, classes[c.program][1])
        argv = [f"{k}={v}" for k, v in c.arg_flags().items()]
        config = parse_config(config_cls, argv, c.program, "", environ=container_env(c, renders[overlay]))
        assert (config.host, config.port, config.metrics_port) == ("0.0.0.0", c.port("grpc"), c.port("metrics"))
        assert config.drain_timeout_s == 30
        if c.program == "pagoda-scheduler":
            assert config.executors == "pagoda-executor.pagoda.svc.cluster.local:50061"
            assert config.http_port == 8000
        if overlay == "gpu-tls":
            assert config.tls_cert.startswith("/etc/pagoda/tls/")


@pytest.mark.parametrize("overlay", GROUP_OVERLAYS)
def test_executor_groups_keep_no_kv_offload_tier(renders, overlay):
    """A group serves no disk tier: the base's directory is overridden empty, and no pod mounts or claims one."""
    objects = renders[overlay]
    executors = [c for c in containers(objects) if c.program == "pagoda-executor"]
    assert executors
    for executor in executors:
        assert container_env(executor, objects)["PAGODA_KV_OFFLOAD_DIR"] == ""
        assert "/kv-offload" not in {m["mountPath"] for m in executor.spec["volumeMounts"]}
        assert [t["metadata"]["name"] for t in executor.workload["spec"]["volumeClaimTemplates"]] == ["models"]


@pytest.mark.parametrize("overlay", sorted(set(OVERLAYS) - set(GROUP_OVERLAYS)))
def test_each_executor_keeps_its_kv_offload_tier_on_a_volume_of_its_own(renders, overlay):
    """The tier's directory is a per-pod persistent volume (a volumeClaimTemplate), larger than the tier."""
    from pagoda.runtime.flags import parse_size

    objects = renders[overlay]
    executor = _container(objects, "pagoda-executor")
    directory = setting(executor, objects, "--kv-offload-dir")
    mount = next(m for m in executor.spec["volumeMounts"] if m["mountPath"] == directory)
    claims = {t["metadata"]["name"]: t for t in executor.workload["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims and not mount.get("readOnly")
    claim = parse_size(claims[mount["name"]]["spec"]["resources"]["requests"]["storage"].replace("Gi", "GiB"))
    assert parse_size(setting(executor, objects, "--kv-offload-size")) < claim
    if overlay.startswith("gpu"):
        memory = parse_size(setting(executor, objects, "--kv-offload-memory"))
        assert memory < parse_size(executor.spec["resources"]["limits"]["memory"].replace("Gi", "GiB"))
