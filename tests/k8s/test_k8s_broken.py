"""The validation and each consistency check fail, specifically, on a small
deliberately broken fixture (tests/k8s/fixtures/broken)."""

from __future__ import annotations

import pathlib
import re

import k8s_validate as validate
import pytest
from k8s_checks import check_all, check_images_across
from k8s_manifests import kubectl_path, overlay_dirs, render, validate_schemas

pytestmark = pytest.mark.skipif(kubectl_path() is None, reason="kubectl is not installed: k8s/ cannot be rendered")

BROKEN = pathlib.Path(__file__).parent / "fixtures" / "broken"
EXECUTOR = "statefulset/pagoda-executor container executor"
SCHEDULER = "deployment/pagoda-scheduler container scheduler"


@pytest.fixture(scope="module")
def broken() -> list[dict]:
    return render(BROKEN)


@pytest.fixture(scope="module")
def results(broken) -> dict[str, list[str]]:
    return check_all(broken, *validate.known_flags()[:2])


def test_schema_rejects_unknown_field_and_unknown_kind(broken):
    assert validate_schemas(broken) == [
        "statefulset/pagoda-executor: spec.template.spec.containers.0: "
        "Additional properties are not allowed ('imagePullPolcy' was unexpected)",
        "deploymnt/typo: unknown kind: Couldn't find schema for kind Deploymnt "
        "with api version apps/v1 for kubernetes version 1.32",
    ]


def test_selector_mismatch(results):
    assert results["selectors"] == [
        "service/pagoda-scheduler: selector {'app.kubernetes.io/component': 'schedular', "
        "'app.kubernetes.io/name': 'pagoda'} matches no pod template"
    ]


def test_named_target_port_not_declared(results):
    assert results["target_ports"] == [
        "service/pagoda-executor: port metrics targets 'prom', not a container port of pagoda-executor "
        "(['grpc', 'metrics'])"
    ]


def test_executor_address_in_wrong_namespace(results):
    assert results["executor_address"] == [
        f"{SCHEDULER}: --executors is 'pagoda-executor.default.svc.cluster.local:50061', "
        "expected 'pagoda-executor.pagoda.svc.cluster.local:50061'"
    ]


def test_probe_on_undeclared_port(results):
    assert results["probes"] == [f"{EXECUTOR}: readinessProbe on port 50062, which the container does not declare"]


def test_missing_config_map_key(results):
    assert len(results["config_refs"]) == 1
    assert re.fullmatch(
        r"statefulset/pagoda-executor container model-init: env PAGODA_MODEL refers to missing key "
        r"PAGODA_MODEL_PATH of ConfigMap pagoda-executor-config-[a-z0-9]{10}",
        results["config_refs"][0],
    )


def test_variable_that_is_no_flag(results):
    assert results["env_flags"] == [
        f"{SCHEDULER}: PAGODA_MAX_BATCH is not the variable of any flag of pagoda-scheduler"
    ]


def test_grace_period_shorter_than_drain(results):
    assert results["drain"] == [f"{SCHEDULER}: terminationGracePeriodSeconds 20 <= --drain-timeout-s 30"]


def test_scheduler_replicas_replaced_with_a_surge(results):
    assert results["scheduler_replicas"] == [
        f"{SCHEDULER}: replace schedulers one at a time (RollingUpdate with maxSurge 0)"
    ]


def test_unbroken_checks_still_pass(results):
    for check in ("security", "metrics", "resources", "groups"):
        assert results[check] == [], check


def test_images_from_another_repository(broken):
    renders = {"cpu": render(overlay_dirs()["cpu"]), "broken": broken}
    repos = "['docker.io/someone/pagoda-executor', 'ghcr.io/pagoda-llm/pagoda-executor']"
    assert check_images_across(renders, "0.1.0") == [
        f"pagoda-executor/executor: overlays use different repositories {repos}",
        f"pagoda-executor/model-init: overlays use different repositories {repos}",
    ]
    assert check_images_across({"cpu": renders["cpu"]}, "0.2.0")[0] == (
        "cpu: deployment/pagoda-scheduler container scheduler: image tag '0.1.0' is not 0.2.0 or 0.2.0-<cpu|cuda>"
    )
