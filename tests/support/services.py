"""Real service processes for tests that kill them from outside: start, health, SIGKILL, restart, logs.

Each process leads its own session on 127.0.0.1 and appends to its own log
file, so a restarted process continues the same log. Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.launcher import LOOPBACK, free_port, service_command


@dataclasses.dataclass
class Service:
    """One service process (restartable on the same port) and its log file."""

    name: str
    argv: list[str]
    address: str
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    process: subprocess.Popen | None = None

    def start(self) -> Service:
        """Start the process (again), appending to its log."""
        assert not self.alive, f"{self.name} is running"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 30) -> int:
        """Send `sig` from outside (as an operator or the kernel would) and reap; returns the exit status."""
        assert self.process is not None
        if self.alive:
            os.killpg(self.process.pid, sig)
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.alive:
            try:
                self.kill(signal.SIGTERM, timeout_s=20)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)

    def wait_serving(self, timeout_s: float = 120, service: str = "") -> None:
        """Until its health is SERVING; fails with the log's tail when it exits or the time is up."""
        wait_until(
            lambda: check_health(self.address, timeout=1.0, service=service) == ServingStatus.SERVING,
            timeout_s,
            f"{self.name} SERVING",
            self,
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def events(self, *names: str) -> list[dict]:
        """Its JSON log lines whose `event` is one of `names`, in order."""
        found = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("event") in names:
                    found.append(entry)
        return found


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, *watched: Service) -> float:
    """Poll `predicate` every 50 ms up to `timeout_s`; returns the seconds it took. Fails if a watched service exits."""
    start = time.monotonic()
    while not predicate():
        for service in watched:
            assert service.alive, f"{service.name} exited ({service.process.returncode}):\n{service.log_text()[-3000:]}"
        assert time.monotonic() - start < timeout_s, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def executor_service(name: str, model_dir: Path, log_dir: Path, extra: Sequence[str] = ()) -> Service:
    """A tiny-model executor (fp32, 2 MiB of KV cache) on a free port."""
    port = free_port()
    argv = [*service_command("pagoda-executor", "executor_svc.main"), "--host", LOOPBACK, "--port", str(port)]
    argv += ["--model", str(model_dir), "--dtype", "float32", "--kv-cache-memory", "2MiB", "--log-format", "json"]
    return Service(name, argv + list(extra), f"{LOOPBACK}:{port}", log_dir / f"{name}.log")


def scheduler_service(
    scheduler_id: str, executors: Sequence[Service], log_dir: Path, extra: Sequence[str] = ()
) -> Service:
    """A scheduler with id `scheduler_id` over `executors`, on a free port."""
    port = free_port()
    argv = [*service_command("pagoda-scheduler", "scheduler_svc.main"), "--host", LOOPBACK, "--port", str(port)]
    argv += ["--executors", ",".join(e.address for e in executors), "--scheduler-id", scheduler_id]
    argv += ["--log-format", "json"]
    return Service(scheduler_id, argv + list(extra), f"{LOOPBACK}:{port}", log_dir / f"{scheduler_id}.log")


def lease_overlaps(executor: Service) -> list[str]:
    """Lease history of an executor's log: every stream attached while another held the lease, or a reused epoch.

    Each process start (an `executor_listening` line) begins a new history.
    """
    problems, holder, last_epoch = [], None, -1
    for entry in executor.events("executor_listening", "lease_attached", "lease_released"):
        if entry["event"] == "executor_listening":
            holder, last_epoch = None, -1
        elif entry["event"] == "lease_attached":
            if holder is not None:
                problems.append(f"{entry['holder_id']}@{entry['epoch']} attached while {holder} held the lease")
            if entry["epoch"] <= last_epoch:
                problems.append(f"epoch {entry['epoch']} after {last_epoch}")
            holder, last_epoch = f"{entry['holder_id']}@{entry['epoch']}", entry["epoch"]
        else:
            if holder != f"{entry['holder_id']}@{entry['epoch']}":
                problems.append(f"released {entry['holder_id']}@{entry['epoch']} while {holder} held the lease")
            holder = None
    return problems


def read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """`proc`'s stdout up to the line holding `marker`; fails with what it printed when it ends or the time is up.

    One reader thread per process moves its lines to a queue, so the wait is bounded even when it prints nothing.
    """
    lines_queue = _stdout_lines(proc)
    deadline = time.monotonic() + timeout_s
    lines = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines_queue.get(timeout=left)
        except queue.Empty:
            break  # nothing printed before the deadline
        if line is None:
            break  # its stdout closed
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError(f"no {marker!r} within {timeout_s} s in output: {''.join(lines)}")


_line_queues: dict[int, queue.Queue[str | None]] = {}


def _stdout_lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The queue a daemon thread fills with `proc`'s stdout lines (None once it closes), made on first use."""
    if proc.pid not in _line_queues:
        lines: queue.Queue[str | None] = queue.Queue()
        stdout = proc.stdout
        assert stdout is not None

        def pump() -> None:
            for line in iter(stdout.readline, ""):
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name=f"stdout-{proc.pid}", daemon=True).start()
        _line_queues[proc.pid] = lines
    return _line_queues[proc.pid]
