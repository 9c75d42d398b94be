"""The observability components render, validate offline, and speak of metrics the code registers."""

from __future__ import annotations

import copy

import k8s_validate as validate
import pytest
import yaml
from k8s_checks import check_all
from k8s_manifests import K8S_DIR, KUBE_VERSION, kubectl_path, render, validate_schemas
from k8s_observability import (
    alert_rules,
    check_dashboard,
    check_exprs,
    check_prometheus_rule,
    dashboard_exprs,
    dashboard_of,
    metric_names,
)
from k8s_pods import config_maps, container_env, containers

pytestmark = pytest.mark.skipif(kubectl_path() is None, reason="kubectl is not installed: k8s/ cannot be rendered")
EXAMPLE = K8S_DIR / "examples" / "observability"
CRDS = {"PrometheusRule"}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(EXAMPLE)


@pytest.fixture(scope="module")
def known() -> set[str]:
    return metric_names()


def _rule(objects):
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    return rule


def test_renders_the_cpu_overlay_plus_both_components(objects):
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "Namespace", "PodDisruptionBudget", "Service", "StatefulSet", "PrometheusRule"]
    )
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Deployment", "pagoda-otel-collector"), ("Service", "pagoda-otel-collector")} <= names
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"pagoda"}


def test_every_kubernetes_object_validates_strictly(objects):
    assert validate_schemas([o for o in objects if o["kind"] not in CRDS], KUBE_VERSION) == []


def test_the_overlay_checks_hold_with_the_components(objects):
    """The consistency checks of every overlay (flags, probes, security, ...), the collector included."""
    results = check_all(objects, *validate.known_flags()[:2])
    assert {name: errors for name, errors in results.items() if errors} == {}


def test_the_prometheus_rule_is_well_formed_with_the_four_alerts(objects):
    rule = _rule(objects)
    assert check_prometheus_rule(rule) == []
    alerts = {r["alert"] for r in alert_rules(rule)}
    assert alerts == {
        "PagodaNoExecutorReady",
        "PagodaKVCacheNearlyFull",
        "PagodaTTFTOverSLO",
        "PagodaExecutorRestarted",
    }


def test_a_malformed_rule_is_reported(objects):
    rule = copy.deepcopy(_rule(objects))
    first = next(alert_rules(rule))
    first["for"], first["labels"]["severity"], first["extra"] = "ten minutes", "page", 1
    errors = check_prometheus_rule(rule)
    assert len(errors) == 3 and all("PagodaNoExecutorReady" in e for e in errors), errors


def test_the_dashboard_loads_with_every_required_panel(objects):
    dashboard = dashboard_of(objects)
    assert check_dashboard(dashboard) == []
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("throughput", "time to first token", "inter-token", "queue", "kv cache", "preemption",
                  "prefix cache hit rate", "executors by state", "executor restarts"):  # fmt: skip
        assert topic in titles, topic


def test_a_broken_dashboard_is_reported(objects):
    dashboard = copy.deepcopy(dashboard_of(objects))
    dashboard["panels"][1]["id"] = dashboard["panels"][0]["id"]
    dashboard["panels"][2]["gridPos"] = dict(dashboard["panels"][3]["gridPos"])
    dashboard["panels"][4]["targets"][0]["refId"] = dashboard["panels"][4]["targets"][1]["refId"]
    assert len(check_dashboard(dashboard)) == 3


def test_every_expression_parses_and_uses_metrics_the_code_registers(objects, known):
    exprs = dashboard_exprs(dashboard_of(objects)) + [r["expr"] for r in alert_rules(_rule(objects))]
    assert len(exprs) >= 25
    assert check_exprs(exprs, known) == []
    assert {"pagoda:executors", "pagoda:executor_restarts_total", "pagoda_executor_step_seconds_bucket"} <= known


def test_an_unknown_metric_or_a_bad_expression_is_reported(known):
    errors = check_exprs(
        ["sum(rate(pagoda:no_such_metric_total[5m]))", "sum(rate(pagoda:num_preemptions_total[5m]"], known
    )
    assert len(errors) == 2 and "no_such_metric" in errors[0] and "does not parse" in errors[1]


def test_the_services_export_to_the_collector(objects):
    """Both programs' environment names the collector Service's OTLP port, which its receiver listens on."""
    (service,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "pagoda-otel-collector"]
    port = service["spec"]["ports"][0]["port"]
    programs = {c.program: container_env(c, objects) for c in containers(objects) if c.program}
    assert sorted(programs) == ["pagoda-executor", "pagoda-scheduler"]
    assert {env.get("PAGODA_OTLP_ENDPOINT") for env in programs.values()} == {f"http://pagoda-otel-collector:{port}"}
    (config,) = [data for name, data in config_maps(objects).items() if name.startswith("pagoda-otel-collector")]
    receiver = yaml.safe_load(config["config.yaml"])["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert receiver.endswith(f":{port}")


def test_the_components_leave_the_overlays_unchanged():
    """The dashboards, alerts and collector are opt-in: no overlay renders them."""
    for overlay in ("base", "overlays/cpu", "overlays/gpu", "overlays/gpu-tls"):
        rendered = render(K8S_DIR / overlay)
        assert not [o for o in rendered if o["kind"] == "PrometheusRule" or "otel" in o["metadata"]["name"]]
