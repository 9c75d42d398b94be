"""The processes of the control-plane benchmark, and what is read off them.

Simulated executors (`pagoda-executor --simulate`) and schedulers, each its own
process group on 127.0.0.1 with its output in a log file; CPU time from
`/proc/<pid>/stat`, machine load from `/proc/stat`, counters from each
process's Prometheus endpoint. Every wait is bounded and says what it waits for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.launcher import LOOPBACK, service_command
from pagoda.runtime.ports import free_port
from pagoda.v1 import generation_pb2, generation_pb2_grpc

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROFILE_SCRIPT = Path(__file__).with_name("control_plane_profile.py")


@dataclasses.dataclass
class Proc:
    """One child process: its gRPC address, its metrics port and its log."""

    name: str
    process: subprocess.Popen[bytes]
    address: str
    metrics_port: int
    log_path: Path
    http_address: str = ""  # a scheduler's OpenAI-compatible HTTP API, when it serves one

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid


def spawn(
    name: str, argv: list[str], log_dir: Path, address: str, metrics_port: int, checkout: Path | None = None
) -> Proc:
    """Start `argv` in its own process group, its output in `log_dir/<name>.log`.

    With `checkout` (a folder), `argv` runs there with that folder first on its import path, so a
    `python -m` module comes from that checkout whichever environment's interpreter runs it.
    """
    log_path = log_dir / f"{name}.log"
    env = None if checkout is None else {**os.environ, "PYTHONPATH": str(checkout)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=checkout, env=env
        )
    return Proc(name, process, address, metrics_port, log_path)


def stop(procs: Iterable[Proc], grace_s: float = 10.0) -> None:
    """SIGTERM every process group, then SIGKILL what is left after `grace_s`."""
    procs = [p for p in procs if p.process.poll() is None]
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            print(f"{proc.name} (pid {proc.pid}) ignored SIGTERM for {grace_s}s: SIGKILL", file=sys.stderr)
            _signal_group(proc, signal.SIGKILL)
            proc.process.wait(timeout=10)


def _signal_group(proc: Proc, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, sig)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, procs: Sequence[Proc] = ()) -> None:
    """Poll `predicate` until true; raise after `timeout_s`, or as soon as one of `procs` exits."""
    start = time.monotonic()
    last_note = start
    while not predicate():
        dead = next((p for p in procs if p.process.poll() is not None), None)
        if dead is not None:
            tail = dead.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{dead.name} exited ({dead.process.returncode}) while waiting for {what}:\n{tail}")
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        if now - last_note > 10:
            print(f"  still waiting for {what} ({now - start:.0f}s)", file=sys.stderr, flush=True)
            last_note = now
        time.sleep(0.2)


def free_ports(num: int) -> list[int]:
    """`num` distinct TCP ports free a moment ago on 127.0.0.1, outside the ephemeral range."""
    return [free_port() for _ in range(num)]


def start_executors(num: int, log_dir: Path, extra_args: Sequence[str] = (), timeout_s: float = 300) -> list[Proc]:
    """`num` simulated executors, SERVING when this returns (stopped if one fails to come up)."""
    procs: list[Proc] = []
    try:
        ports = free_ports(2 * num)
        for i in range(num):
            port, metrics_port = ports[2 * i], ports[2 * i + 1]
            argv = service_command("pagoda-executor", "executor_svc.main") + ["--simulate", "--host", LOOPBACK]
            argv += ["--port", str(port), "--metrics-port", str(metrics_port), "--log-format", "json", *extra_args]
            procs.append(spawn(f"executor-{i}", argv, log_dir, f"{LOOPBACK}:{port}", metrics_port))
        pending = list(procs)

        def all_serving() -> bool:
            pending[:] = [p for p in pending if check_health(p.address, timeout=1.0) != ServingStatus.SERVING]
            return not pending

        wait_until(all_serving, timeout_s, f"{num} simulated executors to serve", procs)
    except BaseException:
        stop(procs)
        raise
    return procs


def start_schedulers(
    groups: Sequence[Sequence[str]],
    log_dir: Path,
    tag: str,
    extra_args: Sequence[str] = (),
    profile_dir: Path | None = None,
    timeout_s: float = 120,
    http: bool = False,
    checkout: Path | None = None,
) -> list[Proc]:
    """One scheduler per group of executor addresses, each READY on all of them when this returns.

    With `profile_dir`, the schedulers run under control_plane_profile.py: SIGUSR1 starts their profile,
    SIGUSR2 writes it to `profile_dir/<name>.prof`. With `http`, each also serves the OpenAI-compatible
    HTTP API (`--http-port`), answering /health when this returns. With `checkout`, the schedulers are
    that checkout's (`scheduler_command`).
    """
    procs: list[Proc] = []
    try:
        ports = free_ports(3 * len(groups))
        for i, addresses in enumerate(groups):
            name = f"scheduler-{i}-{tag}"
            port, metrics_port, http_port = ports[3 * i : 3 * i + 3]
            argv = scheduler_command(checkout)
            if profile_dir is not None:
                argv = [sys.executable, str(PROFILE_SCRIPT), str(profile_dir / f"{name}.prof")]
            argv += ["--host", LOOPBACK, "--port", str(port), "--metrics-port", str(metrics_port)]
            argv += ["--executors", ",".join(addresses), "--log-format", "json", "--drain-timeout-s", "1"]
            argv += ["--http-port", str(http_port)] if http else []
            proc = spawn(name, argv + list(extra_args), log_dir, f"{LOOPBACK}:{port}", metrics_port, checkout)
            proc.http_address = f"{LOOPBACK}:{http_port}" if http else ""
            procs.append(proc)
        for proc, addresses in zip(procs, groups):
            expected = len(addresses)
            wait_until(
                lambda p=proc, n=expected: num_ready(p.address) == n and (not http or http_serving(p.http_address)),
                timeout_s,
                f"{proc.name} to drive its {expected} executors",
                procs,
            )
    except BaseException:
        stop(procs)
        raise
    return procs


def scheduler_command(checkout: Path | None) -> list[str]:
    """This tree's `pagoda-scheduler`, or the scheduler module of `checkout` by its own .venv's python.

    A checkout without a .venv runs under this interpreter: `spawn` puts the checkout first on the
    import path, so its `scheduler_svc` and `pagoda` are imported, not this tree's.
    """
    if checkout is None:
        return service_command("pagoda-scheduler", "scheduler_svc.main")
    python = checkout / ".venv" / "bin" / "python"
    return [str(python) if python.exists() else sys.executable, "-m", "scheduler_svc.main"]


def http_serving(address: str) -> bool:
    """Whether the HTTP API at `address` answers /health with 200."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=2) as response:
            return response.status == 200
    except OSError:  # not listening yet, or 503 (urllib's HTTPError is an OSError)
        return False


def num_ready(address: str) -> int:
    """Executors READY on the scheduler at `address` (0 when it does not answer)."""
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]
        try:
            status = stub.GetStatus(generation_pb2.GetStatusRequest(), timeout=2.0)
        except grpc.RpcError:
            return 0
    return sum(1 for e in status.executors if e.state == "READY")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15 of stat(5)


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return sum(values) - idle, sum(values)


def scrape(port: int) -> dict[str, float]:
    """Samples of the Prometheus endpoint on 127.0.0.1:`port`, by name (labels dropped, values summed)."""
    with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def scrape_sum(procs: Sequence[Proc], names: Sequence[str]) -> dict[str, float]:
    """Each of `names` summed over the metrics endpoints of `procs` (scraped in parallel)."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        scraped = list(pool.map(lambda p: scrape(p.metrics_port), procs))
    return {name: sum(s.get(name, 0.0) for s in scraped) for name in names}
