"""Executor groups in rendered manifests (docs/parallel-deploy.md): every pod's ranks, where it meets
its group, and what makes the group's pods restart and serve as one executor.

A group's leader (rank 0) is an executor container that declares the Executor API's port; every other
rank's pod declares none. Each pod's settings are read as its process would start: for each ordinal of
its StatefulSet, with the downward API filled in, and a `sh -c` wrapper run for real (`launch`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from k8s_pods import API_PORT_NAME, Container, by_kind, container_env, expand, parse_flags, pod_spec, selects

PROGRAM = "pagoda-executor"
GROUP_PORT_NAME = "group"
# The kubelet's longest crash-loop back-off: a rank restarted after it must still find its peers waiting.
MAX_CRASH_LOOP_BACKOFF_S = 300
# The executor's startup probe allows at least this for loading the model, after the group has met.
MIN_EXECUTOR_STARTUP_S = 300
# What group members must share: the same machine, image, settings and model volume.
_ALIKE_POD = ("nodeSelector", "tolerations", "securityContext", "initContainers", "terminationGracePeriodSeconds")
_ALIKE_CONTAINER = ("image", "envFrom", "resources", "securityContext")
# Stands where the script's program is looked up (PATH) and reports what it was started with.
_REPORTER = f"""#!{sys.executable}
import json, os, sys
json.dump({{"args": sys.argv[1:], "env": dict(os.environ)}}, sys.stdout)
"""


def launch(container: Container, objects: list[dict], pod: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(arguments, environment) the container's program starts with in `pod` (downward-API fields).

    `$(VAR)` in command and args is expanded as the kubelet does; a `sh -c` script runs under sh, with
    the program it ends in (`exec pagoda-executor`) replaced by one that reports what it was given.
    """
    env = container_env(container, objects, pod)
    argv = [expand(a, env) for a in [*(container.spec.get("command") or []), *(container.spec.get("args") or [])]]
    if container.shell_script is None:
        return argv[1:], env
    with tempfile.TemporaryDirectory() as folder:
        program = pathlib.Path(folder) / container.program
        program.write_text(_REPORTER)
        program.chmod(0o755)
        proc = subprocess.run(
            argv, env={**env, "PATH": f"{folder}:{os.environ['PATH']}"}, capture_output=True, text=True, timeout=10
        )
    if proc.returncode != 0 or not proc.stdout:
        raise RuntimeError(f"{container.where}: its script exited {proc.returncode}: {proc.stderr.strip()}")
    started = json.loads(proc.stdout)
    return started["args"], {k: v for k, v in started["env"].items() if k != "PATH"}


@dataclasses.dataclass
class Member:
    """One pod of an executor group, with the settings its process starts with."""

    pod_name: str
    namespace: str
    container: Container
    flags: dict[str, str]

    def get(self, flag: str, default: str = "") -> str:
        return self.flags.get(flag, default)

    @property
    def size(self) -> int:
        return int(self.get("--tensor-parallel-size", "1")) * int(self.get("--pipeline-parallel-size", "1"))

    @property
    def rank(self) -> int:
        return int(self.get("--group-rank", "0"))

    @property
    def ranks(self) -> range:
        """The group ranks this pod's process runs (--group-local-ranks 0: the whole group for rank 0)."""
        local = int(self.get("--group-local-ranks", "0")) or (self.size if self.rank == 0 else 1)
        return range(self.rank, self.rank + local)

    @property
    def serves_api(self) -> bool:
        return self.container.serves_api

    @property
    def where(self) -> str:
        return f"pod {self.pod_name} ({self.container.where})"

    def own_address(self) -> str | None:
        """`<pod>.<its StatefulSet's Service>.<namespace>.svc.cluster.local:<group port>`: where its group meets."""
        service, port = self.container.workload["spec"].get("serviceName"), self.container.port(GROUP_PORT_NAME)
        if not service or port is None:
            return None
        return f"{self.pod_name}.{service}.{self.namespace}.svc.cluster.local:{port}"


def members(objects: list[dict]) -> tuple[list[Member], list[str]]:
    """(pods, errors): every pod of every executor StatefulSet whose process belongs to a group of more
    than one rank or serves no Executor API; an error for each pod whose command does not start."""
    found, errors = [], []
    for sts in by_kind(objects, "StatefulSet"):
        for spec in pod_spec(sts).get("containers", []):
            container = Container(sts, spec, False)
            if container.program != PROGRAM:
                continue
            name, namespace = sts["metadata"]["name"], sts["metadata"].get("namespace", "default")
            for index in range(sts["spec"].get("replicas", 1)):
                pod = f"{name}-{index}"
                try:
                    args, env = launch(container, objects, {"metadata.name": pod, "metadata.namespace": namespace})
                except RuntimeError as exc:
                    errors.append(f"pod {pod}: {exc}")
                    continue
                flags = {
                    "--" + k.removeprefix("PAGODA_").lower().replace("_", "-"): v
                    for k, v in env.items()
                    if k.startswith("PAGODA_")
                }
                member = Member(pod, namespace, container, {**flags, **parse_flags(args)})
                if member.size > 1 or not member.serves_api:
                    found.append(member)
    return found, errors


def _leader_errors(leader: Member, objects: list[dict]) -> list[str]:
    """The leader binds the group's port under its own DNS name, published before it is ready."""
    address, workload = leader.own_address(), leader.container.workload
    if address is None:
        return [f"{leader.where}: a leader of ranks in other pods needs serviceName and a {GROUP_PORT_NAME!r} port"]
    errors = []
    if leader.get("--group-address") != address:
        errors.append(f"{leader.where}: PAGODA_GROUP_ADDRESS is {leader.get('--group-address')!r}, not {address!r}")
    services = [s for s in by_kind(objects, "Service") if s["metadata"]["name"] == workload["spec"]["serviceName"]]
    svc = services[0] if services else {"spec": {}}
    port = leader.container.port(GROUP_PORT_NAME)
    if not (
        svc["spec"].get("clusterIP") == "None"
        and svc["spec"].get("publishNotReadyAddresses") is True
        and selects(svc["spec"].get("selector", {}), workload["spec"]["template"]["metadata"].get("labels", {}))
        and any(
            p.get("targetPort") in (GROUP_PORT_NAME, port) and p["port"] == port for p in svc["spec"].get("ports", [])
        )
    ):
        errors.append(
            f"{leader.where}: service/{workload['spec']['serviceName']} must be headless, select it, publish "
            f"not-ready addresses (its group meets before it is ready) and serve port {GROUP_PORT_NAME} {port}"
        )
    return errors


def _spanning_errors(group: list[Member]) -> list[str]:
    """A group over several pods: restarted whole, waiting long enough for a restarted peer."""
    leader, errors = group[0], []
    timeout_s = float(leader.get("--group-start-timeout-s", "300"))
    if timeout_s <= MAX_CRASH_LOOP_BACKOFF_S:
        errors.append(
            f"{leader.where}: --group-start-timeout-s {timeout_s:g} <= {MAX_CRASH_LOOP_BACKOFF_S}s, the kubelet's "
            "longest back-off: restarted ranks could keep missing each other"
        )
    startup = leader.container.spec.get("startupProbe") or {}
    window = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    if window < timeout_s + MIN_EXECUTOR_STARTUP_S:
        errors.append(
            f"{leader.where}: startupProbe allows {window}s, less than meeting the group "
            f"({timeout_s:g}s) and loading the model ({MIN_EXECUTOR_STARTUP_S}s)"
        )
    for workload in {id(m.container.workload): m.container.workload for m in group}.values():
        if workload["spec"].get("updateStrategy", {}).get("type") != "OnDelete":
            errors.append(
                f"statefulset/{workload['metadata']['name']}: updateStrategy must be OnDelete (a rolling update "
                "would pair updated ranks with old ones in a group)"
            )
    return errors


def _claims(workload: dict) -> list[dict]:
    """The volume claims of each pod: names and specs (labels may differ by role)."""
    return [{"name": t["metadata"]["name"], **t["spec"]} for t in workload["spec"].get("volumeClaimTemplates", [])]


def _alike_errors(group: list[Member]) -> list[str]:
    """Every pod of a group runs on the same machine with the same image, settings and model volume."""
    leader, errors = group[0], []
    lead_pod, lead_spec = pod_spec(leader.container.workload), leader.container.spec
    for member in group[1:]:
        pod, spec = pod_spec(member.container.workload), member.container.spec
        differ = [k for k in _ALIKE_POD if pod.get(k) != lead_pod.get(k)]
        differ += [f"container {k}" for k in _ALIKE_CONTAINER if spec.get(k) != lead_spec.get(k)]
        if _claims(member.container.workload) != _claims(leader.container.workload):
            differ.append("volumeClaimTemplates")
        if differ:
            errors.append(
                f"{member.where}: differs from its leader {leader.pod_name} in {', '.join(sorted(set(differ)))}"
            )
    return errors


def _member_errors(member: Member) -> list[str]:
    """What one pod of a group may not do: serve the API unless it is the leader, use an unserved
    feature, or run a number of GPUs other than its ranks."""
    errors = []
    if member.rank == 0 and not member.serves_api:
        errors.append(f"{member.where}: rank 0, its group's leader, declares no Executor API port {API_PORT_NAME!r}")
    if member.rank != 0 and member.serves_api:
        errors.append(
            f"{member.where}: rank {member.rank} declares the Executor API port {API_PORT_NAME!r}, "
            "which only the leader (rank 0) serves"
        )
    for flag in ("--kv-offload-dir", "--lora"):
        if member.get(flag):
            errors.append(f"{member.where}: {flag} is not served by an executor group")
    device, limits = member.get("--device"), member.container.spec.get("resources", {}).get("limits", {})
    if device.startswith("cuda") and int(limits.get("nvidia.com/gpu", 0)) != len(member.ranks):
        errors.append(f"{member.where}: runs {len(member.ranks)} ranks on {limits.get('nvidia.com/gpu', 0)} GPUs")
    return errors


def _group_errors(group: list[Member], objects: list[dict]) -> list[str]:
    """The pods of one group: together they run every rank once, with one shape and one set of settings."""
    leader = group[0]
    errors = [e for m in group for e in _member_errors(m)]
    ranks = sorted(r for m in group for r in m.ranks)
    if ranks != list(range(leader.size)):
        errors.append(
            f"{leader.where}: its group's pods run ranks {ranks}, not 0..{leader.size - 1} once each "
            f"({len(group)} pods, --tensor-parallel-size x --pipeline-parallel-size = {leader.size})"
        )
    shapes = {(m.get("--tensor-parallel-size"), m.get("--pipeline-parallel-size")) for m in group}
    if len(shapes) > 1:
        errors.append(
            f"{leader.where}: its group's pods disagree on (tensor, pipeline) parallel sizes {sorted(shapes)}"
        )
    if len(leader.ranks) < leader.size:
        errors += _leader_errors(leader, objects) + _spanning_errors(group) + _alike_errors(group)
    return errors


def check_groups(objects: list[dict]) -> list[str]:
    """Every group pod meets at its leader's DNS name and port, each group's pods run its T x P ranks
    once (on as many GPUs), only leaders serve the Executor API, and a group over several pods is
    restarted whole and waits long enough for a restarted peer."""
    found, errors = members(objects)
    leaders = [m for m in found if m.rank == 0]
    groups = {id(m): [m] for m in leaders}
    by_address = {m.own_address(): m for m in leaders if m.own_address()}
    for member in found:
        if member.rank == 0:
            continue
        leader = by_address.get(member.get("--group-address"))
        if leader is None:
            errors.append(
                f"{member.where}: rank {member.rank} meets at {member.get('--group-address')!r}, "
                f"no leader's address ({sorted(by_address) or 'none'})"
            )
        else:
            groups[id(leader)].append(member)
    return errors + [e for group in groups.values() for e in _group_errors(group, objects)]
