"""The images users deploy, built and started as the cpu overlay's manifests start them (`make image-test`).

Builds the scheduler and CPU executor images (scripts/container_images.py), prepares the default model with
the executor's init container, starts the executor and the scheduler with the rendered manifests' command, args,
environment, user, read-only root and volumes (pod_run.py: only the address and ports are local), then checks
through the host's client: a chat answers "Paris", `pagoda status` names the kernel variant this CPU should
load, the image holds and imports every package, and an executor killed with SIGKILL and started again serves
the same prompt from the KV offload volume it kept. Skipped unless PAGODA_IMAGE_TEST is set: a cold build takes
tens of minutes (docs/deploy.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from k8s_local import main_container
from k8s_manifests import overlay_dirs, render
from k8s_pods import containers
from pod_run import exec_in, logs, remove, start, state, wait_exit
from support.installed import IMPORT_ALL, NEEDS_TRITON

from executor_svc.native import variants
from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.launcher import free_port
from pagoda_client import Client
from scripts.container_images import ROOT, build, engine, log, run_engine

pytestmark = [
    pytest.mark.skipif(not os.environ.get("PAGODA_IMAGE_TEST"), reason="make image-test runs it (builds images)"),
    pytest.mark.timeout(5400),
]

EXECUTOR, SCHEDULER, MODEL_INIT = (
    "pagoda-image-test-executor-0",
    "pagoda-image-test-scheduler",
    "pagoda-image-test-init",
)
SERVING_TIMEOUT_S = 600
QUESTION = "What is the capital of France? Answer in one word."
# Several full KV blocks of one shared prefix, so the offload tier has blocks to keep.
LONG_SYSTEM = "You are a geography assistant. " * 20


def wait_until(what: str, ready, timeout_s: float, container: str) -> None:
    """Poll `ready()` until true (bounded; a log line every 15 s); fails at once when `container` stops."""
    deadline, next_log = time.monotonic() + timeout_s, 0.0
    while not ready():
        if state(container)["running"] != "true":
            raise AssertionError(f"{container} stopped while waiting for {what}:\n{logs(container)[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s:\n{logs(container)[-6000:]}")
        if time.monotonic() > next_log:
            log(f"waiting for {what} (at most {timeout_s:.0f} s)")
            next_log = time.monotonic() + 15
        time.sleep(1)


def serving(address: str) -> bool:
    return check_health(address, timeout=2.0) == ServingStatus.SERVING


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    """Both images built and running as the cpu overlay runs them; yields the addresses and the volumes."""
    assert engine() is not None, "no container engine (docker or podman)"
    for image in ("scheduler", "executor-cpu"):
        build(image)
    objects = render(overlay_dirs()["cpu"])
    volumes = tmp_path_factory.mktemp("volumes")
    claims = {"models": volumes / "models", "kv-offload": volumes / "kv-offload"}
    for folder in claims.values():
        folder.mkdir()
        folder.chmod(0o777)  # the pod's fsGroup makes a claim writable by the pod's user
    ports = {name: free_port() for name in ("executor", "executor_metrics", "scheduler", "http", "scheduler_metrics")}
    executor_address, scheduler_address = f"127.0.0.1:{ports['executor']}", f"127.0.0.1:{ports['scheduler']}"
    local = {"PAGODA_HOST": "127.0.0.1"}
    executor_env = local | {
        "PAGODA_PORT": str(ports["executor"]),
        "PAGODA_METRICS_PORT": str(ports["executor_metrics"]),
    }
    scheduler_env = local | {
        "PAGODA_PORT": str(ports["scheduler"]),
        "PAGODA_HTTP_PORT": str(ports["http"]),
        "PAGODA_METRICS_PORT": str(ports["scheduler_metrics"]),
        "PAGODA_EXECUTORS": executor_address,
    }
    init = next(c for c in containers(objects) if c.is_init and c.name == "model-init")
    try:
        start(init, objects, MODEL_INIT, claims, {})
        assert wait_exit(MODEL_INIT, SERVING_TIMEOUT_S) == 0, logs(MODEL_INIT)
        start(main_container(objects, "pagoda-executor"), objects, EXECUTOR, claims, executor_env)
        wait_until(
            f"executor SERVING on {executor_address}", lambda: serving(executor_address), SERVING_TIMEOUT_S, EXECUTOR
        )
        start(main_container(objects, "pagoda-scheduler"), objects, SCHEDULER, claims, scheduler_env)
        wait_until(f"scheduler SERVING on {scheduler_address}", lambda: serving(scheduler_address), 120, SCHEDULER)
        yield {"target": scheduler_address, "executor": executor_address, "kv_offload": claims["kv-offload"]}
    finally:
        for name in (MODEL_INIT, EXECUTOR, SCHEDULER):
            (volumes / f"{name}.log").write_text(logs(name))
        remove(SCHEDULER, EXECUTOR, MODEL_INIT)


def pagoda_cli(*args: str) -> str:
    """The host's `pagoda` command (the client installed by make install), bounded."""
    command = [str(Path(sys.executable).parent / "pagoda"), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_chat_through_the_client_answers_paris(system):
    out = pagoda_cli("chat", QUESTION, "--target", system["target"], "--max-tokens", "16", "--temperature", "0")
    assert "Paris" in out, out


def test_status_names_the_kernel_variant_this_cpu_loads(system):
    expected = variants.choose(variants.PORTABLE, variants.cpu_flags())
    assert expected is not None, "this CPU runs no portable variant"
    status = json.loads(pagoda_cli("status", "--json", "--target", system["target"]))
    (executor,) = status["executors"]
    assert executor["kernels"]["variant"] == expected.name, executor["kernels"]


def test_executor_runs_as_the_non_root_user_on_a_read_only_root(system):
    assert exec_in(EXECUTOR, "id", "-u").stdout.strip() == "10001"
    denied = exec_in(EXECUTOR, "touch", "/opt/venv/written")
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied


def test_executor_image_holds_and_imports_every_package(system):
    """Every package setup.py ships is installed in the image; every module of the executor's packages imports
    from the image's venv (a package left out of the wheel, or a module needing what the image lacks, fails)."""
    sys.path.insert(0, str(ROOT))
    from setup import IMPORT_ROOTS, discover_packages

    packages = discover_packages({name: str(ROOT / folder) for name, folder in IMPORT_ROOTS.items()})
    find = "import importlib.util, sys; print([p for p in sys.argv[1:] if importlib.util.find_spec(p) is None])"
    assert exec_in(EXECUTOR, "python", "-I", "-c", find, *packages).stdout.strip() == "[]"
    proc = exec_in(EXECUTOR, "python", "-I", "-c", IMPORT_ALL, "pagoda", "executor_svc")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = [f for f in report["failures"] if not (f.split(":")[0] in NEEDS_TRITON and "'triton'" in f)]
    assert not failures and not report["outside"], report
    assert "executor_svc.runner.model_runner" in report["modules"]


def test_a_sigkilled_executor_started_again_serves_from_its_kv_offload_volume(system):
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": QUESTION}]
    with Client(system["target"], timeout=300) as client:
        first = client.chat(messages, max_tokens=16, temperature=0)
    assert "Paris" in first.text
    tier_files = lambda: list(system["kv_offload"].rglob("*.kvb"))  # noqa: E731
    wait_until("KV blocks written to the offload volume", lambda: len(tier_files()) >= 4, 120, EXECUTOR)
    with Client(system["target"], timeout=60) as client:
        (before,) = client.status().executors
    log(f"{len(tier_files())} KV blocks on the offload volume; SIGKILL to {EXECUTOR}")
    run_engine(["kill", "--signal", "KILL", EXECUTOR], 60, check=True, capture_output=True)
    assert wait_exit(EXECUTOR, 60) == 137
    run_engine(["start", EXECUTOR], 120, check=True, capture_output=True)
    wait_until("restarted executor SERVING", lambda: serving(system["executor"]), SERVING_TIMEOUT_S, EXECUTOR)
    assert '"event": "kv_offload_scanned"' in logs(EXECUTOR)
    with Client(system["target"], timeout=300, max_retries=5) as client:
        restarted = lambda: executor_ready(client, before.incarnation_id)  # noqa: E731
        wait_until("the scheduler driving the restarted executor", restarted, 120, SCHEDULER)
        again = client.chat(messages, max_tokens=16, temperature=0)
    assert again.text == first.text
    assert again.usage.cached_tokens_offloaded > 0, again.usage


def executor_ready(client: Client, old_incarnation_id: str) -> bool:
    """Whether the scheduler drives the executor again, a new process of it."""
    try:
        (executor,) = client.status(timeout=5).executors
    except Exception:  # the scheduler's answer while it reconnects
        return False
    return executor.state == "READY" and executor.incarnation_id not in ("", old_incarnation_id)
