"""Read rendered objects the way the kubelet would: pod templates, the
containers in them, and each container's effective PAGODA_* settings."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
PROGRAMS = ("pagoda-executor", "pagoda-scheduler")
SHELLS = ("sh", "bash")
# The port of the Executor API (and its health service): only an executor group's leader declares it.
API_PORT_NAME = "grpc"
# The program a `sh -c` script turns into: its `exec` line.
_EXEC_RE = re.compile(r"(?m)^\s*exec\s+(\S+)")


@dataclasses.dataclass
class Container:
    """One container of a pod template, with what it resolves to."""

    workload: dict
    spec: dict
    is_init: bool

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def where(self) -> str:
        kind = self.workload["kind"].lower()
        return f"{kind}/{self.workload['metadata']['name']} container {self.name}"

    @property
    def shell_script(self) -> str | None:
        """The script when the container runs `sh -c SCRIPT` (command and args together)."""
        argv = [*(self.spec.get("command") or []), *(self.spec.get("args") or [])]
        if len(argv) >= 3 and argv[0].rsplit("/", 1)[-1] in SHELLS and argv[1] == "-c":
            return argv[2]
        return None

    @property
    def program(self) -> str | None:
        """`pagoda-executor` / `pagoda-scheduler` when the container runs one, directly or as the
        program a `sh -c` script ends in (`exec pagoda-executor`)."""
        script = self.shell_script
        if script is not None:
            match = _EXEC_RE.search(script)
            name = match.group(1) if match else ""
        else:
            command = self.spec.get("command") or []
            name = command[0] if command else ""
        name = name.rsplit("/", 1)[-1]
        return name if name in PROGRAMS else None

    @property
    def image_program(self) -> str | None:
        """The program whose image this container uses (init containers included)."""
        repo = self.spec.get("image", "").rsplit(":", 1)[0]
        return next((p for p in PROGRAMS if repo.endswith("/" + p) or repo == p), None)

    @property
    def serves_api(self) -> bool:
        """False for the other ranks of an executor group: only its leader serves the Executor API."""
        return self.program != "pagoda-executor" or self.port(API_PORT_NAME) is not None

    def port(self, name: str) -> int | None:
        """containerPort of the port called `name`."""
        return next((p["containerPort"] for p in self.spec.get("ports", []) if p.get("name") == name), None)

    def arg_flags(self) -> dict[str, str]:
        """`--flag=value` / `--flag value` pairs from args."""
        return parse_flags(self.spec.get("args") or [])


def parse_flags(args: list[str]) -> dict[str, str]:
    """`--flag=value` / `--flag value` pairs of an argument list."""
    flags, i = {}, 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            flags[key] = value
        elif arg.startswith("--"):
            has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            flags[arg] = args[i + 1] if has_value else "true"
            i += has_value
        i += 1
    return flags


def pod_spec(workload: dict) -> dict:
    """The pod spec inside a workload's template."""
    return workload["spec"]["template"]["spec"]


def template_labels(workload: dict) -> dict:
    return workload["spec"]["template"].get("metadata", {}).get("labels", {})


def workloads(objects: list[dict]) -> list[dict]:
    return [obj for obj in objects if obj.get("kind") in WORKLOAD_KINDS]


def containers(objects: list[dict]) -> list[Container]:
    """Every container and init container of every workload."""
    found = []
    for workload in workloads(objects):
        spec = pod_spec(workload)
        found += [Container(workload, c, True) for c in spec.get("initContainers", [])]
        found += [Container(workload, c, False) for c in spec.get("containers", [])]
    return found


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj.get("kind") == kind]


def config_maps(objects: list[dict]) -> dict[str, dict]:
    """ConfigMap name -> data."""
    return {cm["metadata"]["name"]: cm.get("data", {}) for cm in by_kind(objects, "ConfigMap")}


def expand(text: str, env: Mapping[str, str]) -> str:
    """`$(VAR)` references replaced as the kubelet replaces them in env values, command and args:
    by VAR's value when it is defined, else left as written; `$$` is a `$`. (So a shell's
    `$((1 + 2))` passes through: `(1 + 2` names no variable.)"""
    out, i = [], 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "(" and (end := text.find(")", i + 2)) >= 0:
            name = text[i + 2 : end]
            out.append(env.get(name, f"$({name})"))
            i = end + 1
        else:
            out.append("$" if text[i + 1] == "$" else text[i : i + 2])
            i += 2
    return "".join(out)


def container_env(container: Container, objects: list[dict], pod: dict[str, str] | None = None) -> dict[str, str]:
    """Environment the container starts with (envFrom first, env wins; `$(VAR)` in a value
    expanded from the variables before it, as the kubelet does).

    A downward-API variable (`fieldRef`) takes its value from `pod` (fieldPath -> value,
    e.g. `{"metadata.name": "pagoda-scheduler-abc"}`), else the placeholder `<fieldPath>`.
    """
    cms, env = config_maps(objects), {}
    for source in container.spec.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref:
            prefix = source.get("prefix", "")
            env.update({prefix + k: v for k, v in cms.get(ref["name"], {}).items()})
    for var in container.spec.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        if ref and ref["key"] in cms.get(ref["name"], {}):
            env[var["name"]] = cms[ref["name"]][ref["key"]]
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field:
            env[var["name"]] = (pod or {}).get(field, f"<{field}>")
    return env


def setting(container: Container, objects: list[dict], flag: str) -> str | None:
    """Effective value of `--flag` for the container: args win over PAGODA_* env."""
    args = container.arg_flags()
    if flag in args:
        return args[flag]
    return container_env(container, objects).get("PAGODA_" + flag[2:].replace("-", "_").upper())


def selects(selector: dict, labels: dict) -> bool:
    """Whether a (non-empty) equality selector matches `labels`."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


_OPERATORS = {
    "In": lambda label, values: label in values,
    "NotIn": lambda label, values: label not in values,
    "Exists": lambda label, values: label is not None,
    "DoesNotExist": lambda label, values: label is None,
}


def selects_pods(selector: dict, labels: dict) -> bool:
    """Whether a (non-empty) label selector (`matchLabels` and `matchExpressions`, as workloads
    and PodDisruptionBudgets have) matches `labels`."""
    equal, expressions = selector.get("matchLabels", {}), selector.get("matchExpressions", [])
    return (
        bool(equal or expressions)
        and all(labels.get(k) == v for k, v in equal.items())
        and all(_OPERATORS[e["operator"]](labels.get(e["key"]), e.get("values", [])) for e in expressions)
    )
