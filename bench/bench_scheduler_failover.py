"""Scheduler failover: from a scheduler's SIGKILL to the survivor holding (and serving from) its executors.

Starts 2 executors and 2 schedulers (ids sched-a, sched-b) over both, on
127.0.0.1. Each round SIGKILLs the scheduler that holds one executor (from
outside, as the kernel would), then measures:
- takeover: kill -> the survivor's GetStatus shows both executors READY (it
  then serves from the dead scheduler's executor too);
- handback: the killed scheduler restarted (same id) -> SERVING again, holding
  its executor (the survivor hands it back).
Prints each round and p50 / max of each.

Usage: python bench/bench_scheduler_failover.py [--model default] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.launcher import LOOPBACK, free_port, service_command
from pagoda_client import Client, PagodaError

READY_TIMEOUT_S = 300.0
FAILOVER_TIMEOUT_S = 30.0


class Proc:
    """A service process in its own session, logging to a file."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path) -> None:
        self.name, self.argv, self.address = name, argv, f"{LOOPBACK}:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def signal(self, sig: int, wait_s: float = 30.0) -> None:
        assert self.process is not None
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)
        self.process.wait(timeout=wait_s)

    def wait_serving(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        started = time.monotonic()
        _wait(lambda: check_health(self.address, timeout=1.0) == ServingStatus.SERVING, timeout_s, self.name, self)
        return time.monotonic() - started


def _wait(predicate, timeout_s: float, what: str, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.process is not None and proc.process.poll() is not None:
            raise SystemExit(f"{proc.name} exited ({proc.process.returncode}); see {proc.log_path}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.01)


def _held(scheduler: Proc) -> set[str]:
    try:
        with Client(scheduler.address, timeout=2, max_retries=0) as client:
            return {e.address for e in client.status().executors if e.state == "READY"}
    except PagodaError:
        return set()


def _round(schedulers: dict[str, Proc]) -> tuple[float, float]:
    a, b = schedulers["sched-a"], schedulers["sched-b"]
    a.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    _wait(lambda: len(_held(b)) == 2, FAILOVER_TIMEOUT_S, "the survivor to hold both executors", b)
    takeover_s = time.monotonic() - killed_at
    restarted_at = time.monotonic()
    a.start().wait_serving()
    _wait(lambda: len(_held(a)) == 1 and len(_held(b)) == 1, FAILOVER_TIMEOUT_S, "the handback", a)
    return takeover_s, time.monotonic() - restarted_at


def _start(model: str, log_dir: Path) -> tuple[list[Proc], dict[str, Proc]]:
    executors = []
    for i in range(2):
        port = free_port()
        argv = [*service_command("pagoda-executor", "executor_svc.main"), "--host", LOOPBACK, "--port", str(port)]
        argv += ["--model", model, "--kv-cache-memory", "256MiB", "--log-format", "json"]
        executors.append(Proc(f"executor-{i}", argv, port, log_dir).start())
    schedulers = {}
    for name in ("sched-a", "sched-b"):
        port = free_port()
        argv = [*service_command("pagoda-scheduler", "scheduler_svc.main"), "--host", LOOPBACK, "--port", str(port)]
        argv += ["--executors", ",".join(e.address for e in executors), "--scheduler-id", name, "--log-format", "json"]
        schedulers[name] = Proc(name, argv, port, log_dir)
    for proc in executors:
        proc.wait_serving()
    for proc in schedulers.values():
        proc.start()
    for proc in schedulers.values():
        proc.wait_serving()
    _wait(lambda: all(len(_held(s)) == 1 for s in schedulers.values()), 60, "one executor per scheduler")
    return executors, schedulers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="pagoda-failover-"))
    print(f"logs: {log_dir}")
    executors, schedulers = _start(args.model, log_dir)
    rows = []
    try:
        for i in range(args.rounds):
            rows.append(_round(schedulers))
            print(f"round {i + 1}: takeover {rows[-1][0]:.2f}s  handback {rows[-1][1]:.2f}s")
    finally:
        for proc in [*schedulers.values(), *executors]:
            proc.signal(signal.SIGTERM)
    for name, column in zip(("takeover", "handback"), zip(*rows)):
        print(f"{name:<12} p50 {statistics.median(column):.2f}s  max {max(column):.2f}s  (n={len(column)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
