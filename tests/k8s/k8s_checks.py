"""Consistency checks of rendered manifests: what a schema cannot see.

Each check takes the objects of one rendering and returns error strings (empty
when consistent); `check_images_across` compares renderings of all overlays.
"""

from __future__ import annotations

import re

from k8s_flags import env_for_flag
from k8s_groups import check_groups
from k8s_pods import (
    API_PORT_NAME,
    Container,
    by_kind,
    config_maps,
    container_env,
    containers,
    pod_spec,
    selects,
    selects_pods,
    setting,
    template_labels,
    workloads,
)

HEALTH_PORT_NAME = API_PORT_NAME
METRICS_PORT_NAME = "metrics"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# The executor loads weights and allocates its KV cache before it is SERVING.
MIN_EXECUTOR_STARTUP_S = 300
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def _svc_id(svc: dict) -> str:
    return f"service/{svc['metadata']['name']}"


def _selected(objects: list[dict], selector: dict) -> list[dict]:
    return [w for w in workloads(objects) if selects(selector, template_labels(w))]


def _pdbs_of(objects: list[dict], labels: dict) -> list[dict]:
    return [p for p in by_kind(objects, "PodDisruptionBudget") if selects_pods(p["spec"].get("selector", {}), labels)]


def check_selectors(objects: list[dict]) -> list[str]:
    """Services and PDBs select pods of some workload; workloads select their own pods."""
    errors = []
    for svc in by_kind(objects, "Service"):
        if not _selected(objects, svc["spec"].get("selector", {})):
            errors.append(f"{_svc_id(svc)}: selector {svc['spec'].get('selector')} matches no pod template")
    for pdb in by_kind(objects, "PodDisruptionBudget"):
        selector = pdb["spec"].get("selector", {})
        if not any(selects_pods(selector, template_labels(w)) for w in workloads(objects)):
            errors.append(f"poddisruptionbudget/{pdb['metadata']['name']}: selector {selector} matches no pod template")
    for w in workloads(objects):
        selector = w["spec"].get("selector", {})
        if not selects_pods(selector, template_labels(w)):
            name = f"{w['kind'].lower()}/{w['metadata']['name']}"
            errors.append(f"{name}: selector {selector.get('matchLabels', selector)} does not match its template")
    return errors


def _port_names(workload: dict) -> dict[str, int]:
    spec = pod_spec(workload)
    return {
        p["name"]: p["containerPort"] for c in spec.get("containers", []) for p in c.get("ports", []) if "name" in p
    }


def check_target_ports(objects: list[dict]) -> list[str]:
    """Every Service port's targetPort is a declared container port of each selected pod."""
    errors = []
    for svc in by_kind(objects, "Service"):
        for w in _selected(objects, svc["spec"].get("selector", {})):
            ports = _port_names(w)
            for port in svc["spec"].get("ports", []):
                target = port.get("targetPort", port["port"])
                known = target in ports if isinstance(target, str) else target in ports.values()
                if not known:
                    errors.append(
                        f"{_svc_id(svc)}: port {port.get('name', port['port'])} targets {target!r}, "
                        f"not a container port of {w['metadata']['name']} ({sorted(ports)})"
                    )
    return errors


def _of_program(objects: list[dict], program: str) -> list[Container]:
    return [c for c in containers(objects) if c.program == program]


def _headless_address(objects: list[dict], executor: Container) -> tuple[str | None, list[str]]:
    """(expected executor address, errors) from the headless Service of the executors. An executor
    group's rendezvous Service (not-ready addresses published, no Executor API port) is not it."""
    labels, errors, grpc_port = template_labels(executor.workload), [], executor.port(HEALTH_PORT_NAME)
    headless = [
        s
        for s in by_kind(objects, "Service")
        if s["spec"].get("clusterIP") == "None" and selects(s["spec"].get("selector", {}), labels)
    ]
    if executor.workload["kind"] == "StatefulSet" and executor.workload["spec"].get("serviceName") not in {
        s["metadata"]["name"] for s in headless
    }:
        errors.append(f"{executor.where}: serviceName is not a headless Service selecting it")
    services = [
        s
        for s in headless
        if not s["spec"].get("publishNotReadyAddresses")
        or any(p.get("targetPort") in (HEALTH_PORT_NAME, grpc_port) for p in s["spec"].get("ports", []))
    ]
    if len(services) != 1:
        return None, errors + [f"{executor.where}: expected one headless Service selecting it, found {len(services)}"]
    svc = services[0]
    if svc["spec"].get("publishNotReadyAddresses"):
        errors.append(f"{_svc_id(svc)}: publishNotReadyAddresses must be false (unready executors must leave DNS)")
    ports = [p["port"] for p in svc["spec"].get("ports", []) if p.get("targetPort") in (HEALTH_PORT_NAME, grpc_port)]
    if not ports:
        return None, errors + [f"{_svc_id(svc)}: no port targets the executor's {HEALTH_PORT_NAME} port"]
    meta = svc["metadata"]
    return f"{meta['name']}.{meta.get('namespace', 'default')}.svc.cluster.local:{ports[0]}", errors


def check_executor_address(objects: list[dict]) -> list[str]:
    """The scheduler's --executors is `<headless service>.<namespace>.svc.cluster.local:<port>`."""
    schedulers = _of_program(objects, "pagoda-scheduler")
    executors = [c for c in _of_program(objects, "pagoda-executor") if c.serves_api]
    if not schedulers or not executors:
        return [f"need a scheduler and an executor, found {len(schedulers)} and {len(executors)}"]
    expected, errors = _headless_address(objects, executors[0])
    for sched in schedulers:
        actual = setting(sched, objects, "--executors")
        if expected and actual != expected:
            errors.append(f"{sched.where}: --executors is {actual!r}, expected {expected!r}")
    return errors


def _probe_port(probe: dict) -> int | None:
    if "grpc" in probe:
        return probe["grpc"]["port"]
    command = probe.get("exec", {}).get("command", [])
    if any(part.endswith("health_probe.py") for part in command):
        return next((int(p.split("=", 1)[1]) for p in command if p.startswith("--port=")), None)
    return None


def _check_container_probes(c: Container, objects: list[dict]) -> list[str]:
    if not c.serves_api:
        # An executor group's other rank (k8s_groups checks it): nothing to ask, it is alive while its
        # process runs, which exits when its group breaks.
        return [f"{c.where}: {kind} on a group rank that serves no health service" for kind in PROBES if kind in c.spec]
    errors, health_port = [], c.port(HEALTH_PORT_NAME)
    declared = {p["containerPort"] for p in c.spec.get("ports", [])}
    configured = setting(c, objects, "--port")
    if health_port is None or configured is None or int(configured) != health_port:
        errors.append(f"{c.where}: --port is {configured}, container port {HEALTH_PORT_NAME!r} is {health_port}")
    for kind in PROBES:
        probe = c.spec.get(kind)
        port = _probe_port(probe) if probe else None
        if probe is None:
            errors.append(f"{c.where}: no {kind}")
        elif port is None:
            errors.append(f"{c.where}: {kind} is not a gRPC health check")
        elif port not in declared:
            errors.append(f"{c.where}: {kind} on port {port}, which the container does not declare")
        elif port != health_port:
            errors.append(f"{c.where}: {kind} on port {port}, not the health ({HEALTH_PORT_NAME}) port {health_port}")
    startup = c.spec.get("startupProbe") or {}
    window = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    if c.program == "pagoda-executor" and window < MIN_EXECUTOR_STARTUP_S:
        errors.append(
            f"{c.where}: startupProbe allows {window}s for model loading, less than {MIN_EXECUTOR_STARTUP_S}s"
        )
    return errors


def check_probes(objects: list[dict]) -> list[str]:
    """Startup, readiness and liveness probes query the health service on the gRPC port."""
    return [e for c in containers(objects) if c.program for e in _check_container_probes(c, objects)]


def check_config_refs(objects: list[dict]) -> list[str]:
    """Every referenced ConfigMap exists and has every referenced key."""
    cms, errors = config_maps(objects), []
    for c in containers(objects):
        for source in c.spec.get("envFrom", []):
            ref = source.get("configMapRef")
            if ref and ref["name"] not in cms and not ref.get("optional"):
                errors.append(f"{c.where}: envFrom ConfigMap {ref['name']} does not exist")
        for var in c.spec.get("env", []):
            ref = var.get("valueFrom", {}).get("configMapKeyRef")
            if ref and not ref.get("optional") and ref["key"] not in cms.get(ref["name"], {}):
                errors.append(
                    f"{c.where}: env {var['name']} refers to missing key {ref['key']} of ConfigMap {ref['name']}"
                )
    for w in workloads(objects):
        for vol in pod_spec(w).get("volumes", []):
            ref = vol.get("configMap")
            if ref and ref["name"] not in cms and not ref.get("optional"):
                errors.append(
                    f"{w['kind'].lower()}/{w['metadata']['name']}: volume ConfigMap {ref['name']} does not exist"
                )
    return errors


def _check_container_flags(c: Container, objects: list[dict], flags: dict, extras: dict) -> list[str]:
    program = c.program or c.image_program
    known = flags[program]
    allowed_envs = {env_for_flag(f) for f in known} | (extras[program] if not c.program else set())
    errors = [
        f"{c.where}: {name} is not the variable of any flag of {program}"
        for name in sorted(container_env(c, objects))
        if name.startswith("PAGODA_") and name not in allowed_envs
    ]
    for flag in sorted(c.arg_flags()):
        if flag not in known:
            errors.append(f"{c.where}: argument {flag} is not a flag of {program}")
        elif c.program and env_for_flag(flag) in container_env(c, objects):
            errors.append(f"{c.where}: {flag} is given both as an argument and as {env_for_flag(flag)}")
    return errors


def check_env_flags(objects: list[dict], flags: dict[str, set[str]], extras: dict[str, set[str]]) -> list[str]:
    """Every PAGODA_X variable and every --x argument is a real flag of the program.

    Args:
        flags: program -> its long flags.
        extras: program -> documented PAGODA_* variables that are not flags
            (allowed in init containers that run helpers of the image, not the program).
    """
    return [
        e
        for c in containers(objects)
        if c.program or c.image_program
        for e in _check_container_flags(c, objects, flags, extras)
    ]


def check_drain(objects: list[dict]) -> list[str]:
    """terminationGracePeriodSeconds exceeds each program's --drain-timeout-s."""
    errors = []
    for c in containers(objects):
        if not c.program:
            continue
        drain = float(setting(c, objects, "--drain-timeout-s") or DEFAULT_DRAIN_TIMEOUT_S)
        grace = pod_spec(c.workload).get("terminationGracePeriodSeconds", 30)
        if grace <= drain:
            errors.append(f"{c.where}: terminationGracePeriodSeconds {grace} <= --drain-timeout-s {drain:g}")
    return errors


def _pod_security_errors(w: dict) -> list[str]:
    spec, where = pod_spec(w), f"{w['kind'].lower()}/{w['metadata']['name']}"
    ctx, errors = spec.get("securityContext", {}), []
    if not ctx.get("runAsNonRoot") or not ctx.get("runAsUser"):
        errors.append(f"{where}: pod must set runAsNonRoot and a non-zero runAsUser")
    if ctx.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        errors.append(f"{where}: pod seccompProfile must be RuntimeDefault")
    if spec.get("enableServiceLinks", True):
        errors.append(f"{where}: enableServiceLinks must be false (service links inject PAGODA_* variables)")
    if spec.get("automountServiceAccountToken", True):
        errors.append(f"{where}: automountServiceAccountToken must be false (no API access needed)")
    return errors


def _container_security_errors(c: Container) -> list[str]:
    ctx, errors = c.spec.get("securityContext", {}), []
    if ctx.get("readOnlyRootFilesystem") is not True:
        errors.append(f"{c.where}: readOnlyRootFilesystem must be true")
    if ctx.get("allowPrivilegeEscalation") is not False:
        errors.append(f"{c.where}: allowPrivilegeEscalation must be false")
    if "ALL" not in ctx.get("capabilities", {}).get("drop", []):
        errors.append(f"{c.where}: capabilities must drop ALL")
    volumes = {v["name"]: v for v in pod_spec(c.workload).get("volumes", [])}
    tmp = [m for m in c.spec.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
    if not tmp or "emptyDir" not in volumes.get(tmp[0]["name"], {}):
        errors.append(f"{c.where}: /tmp must be an emptyDir (the root filesystem is read-only)")
    return errors


def check_security(objects: list[dict]) -> list[str]:
    """Non-root, read-only root filesystem with an emptyDir /tmp, no capabilities, seccomp."""
    errors = [e for w in workloads(objects) for e in _pod_security_errors(w)]
    return errors + [e for c in containers(objects) for e in _container_security_errors(c)]


def check_metrics(objects: list[dict]) -> list[str]:
    """Prometheus annotations point at the container's metrics port, which --metrics-port serves."""
    errors = []
    for c in containers(objects):
        if not c.program:
            continue
        notes = c.workload["spec"]["template"].get("metadata", {}).get("annotations", {})
        port, configured = c.port(METRICS_PORT_NAME), setting(c, objects, "--metrics-port")
        if not c.serves_api:
            if notes.get("prometheus.io/scrape") == "true":
                errors.append(f"{c.where}: a group rank without the Executor API serves no metrics to scrape")
            continue
        if notes.get("prometheus.io/scrape") != "true":
            errors.append(f'{c.where}: pod template lacks prometheus.io/scrape: "true"')
        if port is None or notes.get("prometheus.io/port") != str(port) or configured != str(port):
            errors.append(
                f"{c.where}: prometheus.io/port {notes.get('prometheus.io/port')}, "
                f"container port {METRICS_PORT_NAME!r} {port} and --metrics-port {configured} differ"
            )
    return errors


def check_resources(objects: list[dict]) -> list[str]:
    """Requests and limits everywhere; a CUDA executor gets a GPU and a memory-backed /dev/shm."""
    errors = []
    for c in containers(objects):
        res = c.spec.get("resources", {})
        for part in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(res.get(part, {}))
            if missing:
                errors.append(f"{c.where}: no {part} for {', '.join(sorted(missing))}")
        gpus = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
        if c.program == "pagoda-executor" and (setting(c, objects, "--device") or "").startswith("cuda") and not gpus:
            errors.append(f"{c.where}: --device cuda without an nvidia.com/gpu limit")
        if gpus:
            volumes = {v["name"]: v for v in pod_spec(c.workload).get("volumes", [])}
            shm = [m for m in c.spec.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            if not shm or volumes.get(shm[0]["name"], {}).get("emptyDir", {}).get("medium") != "Memory":
                errors.append(f"{c.where}: a GPU container needs /dev/shm as an emptyDir with medium Memory")
    return errors


def _scheduler_replica_errors(c: Container, objects: list[dict]) -> list[str]:
    spec, errors = c.workload["spec"], []
    ids = [v for v in c.spec.get("env", []) if v["name"] == env_for_flag("--scheduler-id")]
    from_pod_name = ids and ids[0].get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name"
    if not from_pod_name or "--scheduler-id" in c.arg_flags():
        errors.append(f"{c.where}: {spec['replicas']} replicas need PAGODA_SCHEDULER_ID from the pod name (fieldRef)")
    strategy = spec.get("strategy", {})
    if strategy.get("type") == "Recreate" or str(strategy.get("rollingUpdate", {}).get("maxSurge", "25%")) != "0":
        errors.append(f"{c.where}: replace schedulers one at a time (RollingUpdate with maxSurge 0)")
    if not _pdbs_of(objects, template_labels(c.workload)):
        errors.append(f"{c.where}: no PodDisruptionBudget keeps one scheduler up during voluntary disruptions")
    return errors


def check_scheduler_replicas(objects: list[dict]) -> list[str]:
    """Several schedulers share the executors through leases (docs/durability.md): each replica
    needs its own id (the pod name), replicas are replaced one at a time (a surge replica could own
    no executor and never turn ready), and a PodDisruptionBudget keeps one up. One replica needs none of it."""
    return [
        e
        for c in _of_program(objects, "pagoda-scheduler")
        if c.workload["spec"].get("replicas", 1) > 1
        for e in _scheduler_replica_errors(c, objects)
    ]


_TAG_RE = re.compile(r"^(?P<version>\d+\.\d+\.\d+)(?:-(?P<variant>cpu|cuda))?$")


def _split_image(image: str) -> tuple[str, str]:
    repo, _, tag = image.rpartition(":")
    return (repo, tag) if repo and "/" not in tag else (image, "")


def check_images_across(renders: dict[str, list[dict]], version: str) -> list[str]:
    """Each container uses one repository in every overlay; tags are `<version>` or
    `<version>-<cpu|cuda>`; an init container uses its pod's main image."""
    repos: dict[str, set[str]] = {}
    errors = []
    for overlay, objects in renders.items():
        for c in containers(objects):
            repo, tag = _split_image(c.spec.get("image", ""))
            repos.setdefault(f"{c.workload['metadata']['name']}/{c.name}", set()).add(repo)
            match = _TAG_RE.match(tag)
            if not match or match["version"] != version:
                errors.append(f"{overlay}: {c.where}: image tag {tag!r} is not {version} or {version}-<cpu|cuda>")
            main = pod_spec(c.workload)["containers"][0]["image"]
            if c.is_init and c.image_program and c.spec["image"] != main:
                errors.append(f"{overlay}: {c.where}: image {c.spec['image']} differs from the pod's {main}")
    for key, found in sorted(repos.items()):
        if len(found) > 1:
            errors.append(f"{key}: overlays use different repositories {sorted(found)}")
    return errors


def check_all(objects: list[dict], flags: dict[str, set[str]], extras: dict[str, set[str]]) -> dict[str, list[str]]:
    """Every single-rendering check, by name."""
    return {
        "selectors": check_selectors(objects),
        "target_ports": check_target_ports(objects),
        "executor_address": check_executor_address(objects),
        "probes": check_probes(objects),
        "config_refs": check_config_refs(objects),
        "env_flags": check_env_flags(objects, flags, extras),
        "drain": check_drain(objects),
        "security": check_security(objects),
        "metrics": check_metrics(objects),
        "resources": check_resources(objects),
        "scheduler_replicas": check_scheduler_replicas(objects),
        "groups": check_groups(objects),
    }
