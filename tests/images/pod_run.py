"""Start a rendered manifest's container with the container engine, as the kubelet would start it.

From the manifest: the image, command and args, the environment (config maps, downward API), the user and
group, the read-only root, dropped capabilities, no privilege escalation, and each volume mount (an emptyDir as a
tmpfs, a claim as a host folder, read-only where the mount is). Swapped for this machine: the network (the host's;
the engine's bridge is not available everywhere) and so the address and ports (127.0.0.1, free ports), given as
`overrides`. CPU and memory limits are left out: cgroup limits need a delegated cgroup tree that CI machines lack.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from k8s_pods import Container, container_env, pod_spec

from scripts.container_images import engine, log, run_engine

# An emptyDir's size when the manifest gives none.
DEFAULT_TMPFS = "256m"


def security_args(container: Container) -> list[str]:
    """--user, --read-only, --cap-drop, no-new-privileges: the pod's and the container's securityContext."""
    pod = pod_spec(container.workload).get("securityContext", {})
    own = container.spec.get("securityContext", {})
    user, group = own.get("runAsUser", pod.get("runAsUser")), own.get("runAsGroup", pod.get("runAsGroup"))
    args = ["--user", f"{user}:{group}"] if user is not None else []
    if own.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    args += [f"--cap-drop={cap}" for cap in own.get("capabilities", {}).get("drop", [])]
    if own.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    return args


def volume_args(container: Container, claims: dict[str, Path]) -> list[str]:
    """One mount per volumeMount: emptyDir -> tmpfs (its sizeLimit), claim -> the host folder `claims[name]`."""
    volumes = {v["name"]: v for v in pod_spec(container.workload).get("volumes", [])}
    args = []
    for mount in container.spec.get("volumeMounts", []):
        name, target = mount["name"], mount["mountPath"]
        if name in claims:
            mode = "ro" if mount.get("readOnly") else "rw"
            args += ["-v", f"{claims[name]}:{target}:{mode}"]
        elif "emptyDir" in volumes.get(name, {}):
            size = volumes[name]["emptyDir"].get("sizeLimit", DEFAULT_TMPFS).replace("Gi", "g").replace("Mi", "m")
            args += ["--tmpfs", f"{target}:rw,size={size},mode=1777"]
        else:
            raise AssertionError(f"{container.where}: volume {name} is neither a claim given here nor an emptyDir")
    return args


def run_args(
    container: Container, objects: list[dict], name: str, claims: dict[str, Path], overrides: dict[str, str]
) -> list[str]:
    """`run` arguments for the container, detached, on the host's network."""
    env = container_env(container, objects, {"metadata.name": name}) | overrides
    command = container.spec.get("command") or []
    args = ["run", "-d", "--name", name, "--network", "host", *security_args(container)]
    args += volume_args(container, claims)
    args += [arg for key, value in sorted(env.items()) for arg in ("-e", f"{key}={value}")]
    if command:
        args += ["--entrypoint", command[0]]
    return [*args, container.spec["image"], *command[1:], *(container.spec.get("args") or [])]


def remove_args(name: str) -> list[str]:
    """`rm` at once, running or not (podman would first wait 10 s for SIGTERM; docker kills at once)."""
    return ["rm", "-f", *(["-t", "0"] if engine() == "podman" else []), name]


def start(container: Container, objects: list[dict], name: str, claims: dict[str, Path], overrides: dict[str, str]):
    """Start the container (any old one of that name removed first)."""
    run_engine(remove_args(name), 120, capture_output=True)
    log(f"starting {name} from {container.where}")
    run_engine(run_args(container, objects, name, claims, overrides), 300, check=True, capture_output=True)


def state(name: str) -> dict[str, str]:
    """The container's Status, Running and ExitCode, as the engine reports them."""
    out = run_engine(
        ["inspect", "-f", "{{.State.Status}} {{.State.Running}} {{.State.ExitCode}}", name],
        60,
        capture_output=True,
        check=True,
    ).stdout.split()
    return {"status": out[0], "running": out[1], "exit_code": out[2]}


def logs(name: str) -> str:
    """The container's output (stdout and stderr)."""
    proc = run_engine(["logs", name], 60, capture_output=True)
    return proc.stdout + proc.stderr


def wait_exit(name: str, timeout_s: float) -> int:
    """Until the container has exited (bounded, a log line every 15 s); its exit code."""
    deadline, next_log = time.monotonic() + timeout_s, 0.0
    while (now := state(name))["running"] == "true":
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} still running after {timeout_s:.0f} s:\n{logs(name)[-4000:]}")
        if time.monotonic() > next_log:
            log(f"waiting for {name} to exit (at most {timeout_s:.0f} s)")
            next_log = time.monotonic() + 15
        time.sleep(1)
    return int(now["exit_code"])


def remove(*names: str) -> None:
    """Remove the containers, running or not."""
    for name in names:
        run_engine(remove_args(name), 120, capture_output=True)


def exec_in(name: str, *command: str) -> subprocess.CompletedProcess[str]:
    """Run a command in the running container (as its user)."""
    return run_engine(["exec", name, *command], 300, capture_output=True)
