"""Offline checks of the observability components (k8s/components/monitoring, otel-collector).

- PrometheusRule is a CRD that the Kubernetes schemas do not know: checked
  structurally here (the Prometheus Operator's required fields, durations,
  severities, unique alert names).
- The Grafana dashboard has no offline schema validator on PyPI: checked
  structurally (ids, grid, targets, datasource variable).
- Every PromQL expression parses with `promql-parser` (Grafana's
  `$__rate_interval`/`$__range` replaced by a duration first), and every
  metric it selects is one the code registers (`metric_names`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import promql_parser

ALERT_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
SEVERITIES = {"critical", "warning", "info"}
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
GRID_COLUMNS = 24
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}


def metric_names() -> set[str]:
    """Every series name the scheduler's and the executor's metrics expose (from their registries)."""
    from executor_svc.serving.metrics import ExecutorMetrics
    from scheduler_svc.config import SchedulerServiceConfig
    from scheduler_svc.engine import Engine

    registries = [Engine(SchedulerServiceConfig()).metrics.registry, ExecutorMetrics().registry]
    return {f.name + suffix for r in registries for f in r.collect() for suffix in _SUFFIXES[f.type]}


def selected_metrics(expr: str) -> set[str]:
    """Metric names an expression selects (raises ValueError when it does not parse)."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    names, stack = set(), [promql_parser.parse(expr)]
    while stack:
        node = stack.pop()
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
        for attr in ("lhs", "rhs", "expr", "vector_selector", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, float, int)):
                stack.append(child)
        stack += list(getattr(node, "args", None) or ())
    return names


def check_exprs(exprs: list[str], known: set[str]) -> list[str]:
    """One error per expression that does not parse or selects a metric the code does not register."""
    errors = []
    for expr in exprs:
        try:
            unknown = selected_metrics(expr) - known
        except ValueError as exc:
            errors.append(f"{expr!r} does not parse: {exc}")
            continue
        errors += [f"{expr!r}: no metric {name!r} in the code" for name in sorted(unknown)]
    return errors


def alert_rules(rule: dict) -> Iterator[dict]:
    for group in rule["spec"]["groups"]:
        yield from group["rules"]


def check_prometheus_rule(rule: dict) -> list[str]:
    """The fields the Prometheus Operator requires, and what makes an alert useful."""
    errors = []
    if (rule.get("apiVersion"), rule.get("kind")) != ("monitoring.coreos.com/v1", "PrometheusRule"):
        errors.append(f"not a monitoring.coreos.com/v1 PrometheusRule: {rule.get('apiVersion')} {rule.get('kind')}")
    groups = rule.get("spec", {}).get("groups") or []
    if not groups or not all(g.get("name") and g.get("rules") for g in groups):
        return [*errors, "spec.groups: each group needs a name and rules"]
    names = [r.get("alert") for r in alert_rules(rule)]
    errors += [f"alert {n!r} appears twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for r in alert_rules(rule):
        where = f"alert {r.get('alert')!r}"
        errors += [f"{where}: unknown field {k!r}" for k in sorted(set(r) - ALERT_KEYS)]
        if not r.get("alert") or not isinstance(r.get("expr"), str):
            errors.append(f"{where}: alert and expr are required")
        if "for" in r and not DURATION.match(str(r["for"])):
            errors.append(f"{where}: for {r['for']!r} is not a duration")
        if r.get("labels", {}).get("severity") not in SEVERITIES:
            errors.append(f"{where}: labels.severity must be one of {sorted(SEVERITIES)}")
        if not {"summary", "description"} <= set(r.get("annotations", {})):
            errors.append(f"{where}: annotations need summary and description")
    return errors


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def check_dashboard(dashboard: dict) -> list[str]:
    """Structure Grafana needs to load the dashboard: identity, unique panel ids, a grid, queries, datasource."""
    errors = [f"missing {k}" for k in ("uid", "title", "schemaVersion", "panels") if k not in dashboard]
    variables = {v["name"] for v in dashboard.get("templating", {}).get("list", []) if v.get("type") == "datasource"}
    ids = [p.get("id") for p in dashboard.get("panels", [])]
    errors += [f"panel id {i} appears twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    cells: set[tuple[int, int]] = set()
    for panel in dashboard.get("panels", []):
        where = f"panel {panel.get('id')} ({panel.get('title')})"
        grid = panel.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in "xywh") or grid["x"] + grid["w"] > GRID_COLUMNS:
            errors.append(f"{where}: gridPos {grid} is not within {GRID_COLUMNS} columns")
            continue
        mine = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        errors += [f"{where}: overlaps another panel"] if mine & cells else []
        cells |= mine
        refs = [t.get("refId") for t in panel.get("targets", [])]
        if not refs or len(set(refs)) != len(refs) or not all(t.get("expr") for t in panel["targets"]):
            errors.append(f"{where}: targets need an expr and a unique refId each")
        uid = panel.get("datasource", {}).get("uid", "")
        if uid.strip("${}") not in variables:
            errors.append(f"{where}: datasource {uid!r} is not a datasource variable")
    return errors


def dashboard_of(objects: list[dict]) -> dict:
    """The dashboard JSON of the ConfigMap that Grafana's sidecar loads (label grafana_dashboard=1)."""
    maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"].get("labels", {}).get("grafana_dashboard")]
    assert len(maps) == 1, [o["metadata"]["name"] for o in maps]
    (text,) = maps[0]["data"].values()
    return json.loads(text)
