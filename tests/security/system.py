"""Start a real executor + scheduler with TLS, mTLS or API keys.

`pagoda.launch.launcher.Launcher` checks health and readiness over plaintext
without a key, so it cannot start a system that requires TLS or an API key;
this helper does the same with the credentials and key the test gives.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.launch.launcher import LOOPBACK, free_port, service_command
from pagoda.v1 import generation_pb2, generation_pb2_grpc


@dataclasses.dataclass
class Child:
    """One service process and its log file."""

    name: str
    argv: list[str]
    address: str
    log_path: Path
    process: subprocess.Popen | None = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class SecureSystem:
    """One executor and one scheduler on the tiny model, started with extra flags.

    Args:
        model_dir: checkpoint folder.
        log_dir: each process writes `<name>.log` here.
        executor_args, scheduler_args: extra flags (TLS, keys, limits).
        executor_health_creds: credentials to check the executor's health.
        scheduler_creds: credentials of the client channel to the scheduler.
        api_key: key sent by the readiness check.
        executor_server_name: name to check the executor's certificate against.
        executor_route: address the scheduler dials instead of the executor's (a test proxy).
        with_scheduler: False starts the executor alone.
    """

    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        *,
        executor_args: Sequence[str] = (),
        scheduler_args: Sequence[str] = (),
        executor_health_creds: grpc.ChannelCredentials | None = None,
        scheduler_creds: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
        kv_cache_memory: str = "256KiB",
        executor_server_name: str = "",
        executor_route: str = "",
        with_scheduler: bool = True,
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        executor_port, self.port = free_port(), free_port()
        self.executor = Child(
            "executor",
            [
                *service_command("pagoda-executor", "executor_svc.main"),
                "--host",
                LOOPBACK,
                "--port",
                str(executor_port),
                "--model",
                str(model_dir),
                "--dtype",
                "float32",
                "--kv-cache-memory",
                kv_cache_memory,
                "--log-format",
                "json",
                *executor_args,
            ],
            f"{LOOPBACK}:{executor_port}",
            log_dir / "executor.log",
        )
        self.scheduler = Child(
            "scheduler",
            [
                *service_command("pagoda-scheduler", "scheduler_svc.main"),
                "--host",
                LOOPBACK,
                "--port",
                str(self.port),
                "--executors",
                executor_route or self.executor.address,
                "--log-format",
                "json",
                *scheduler_args,
            ],
            f"{LOOPBACK}:{self.port}",
            log_dir / "scheduler.log",
        )
        self._executor_health_creds = executor_health_creds
        self._scheduler_creds = scheduler_creds
        self._api_key = api_key
        self._executor_server_name = executor_server_name
        self._with_scheduler = with_scheduler

    @property
    def target(self) -> str:
        return self.scheduler.address

    def __enter__(self) -> SecureSystem:
        try:
            self._spawn(self.executor)
            self._wait_healthy(self.executor, self._executor_health_creds, self._executor_server_name)
            if not self._with_scheduler:
                return self
            self._spawn(self.scheduler)
            self._wait_healthy(self.scheduler, self._scheduler_creds)
            self._wait_executor_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _spawn(self, child: Child) -> None:
        with open(child.log_path, "ab") as log:
            child.process = subprocess.Popen(
                child.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _check_alive(self, child: Child) -> None:
        if child.process is not None and child.process.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.process.returncode}):\n{child.log_text()[-3000:]}")

    def _wait_healthy(
        self, child: Child, creds: grpc.ChannelCredentials | None, server_name: str = "", timeout_s: float = 120
    ) -> None:
        end = time.monotonic() + timeout_s
        while not is_serving(child.address, creds, server_name):
            self._check_alive(child)
            assert time.monotonic() < end, f"{child.name} not healthy:\n{child.log_text()[-3000:]}"
            time.sleep(0.2)

    def channel(self) -> grpc.Channel:
        """A new channel to the scheduler with the test's credentials."""
        return open_channel(self.target, self._scheduler_creds)

    def _wait_executor_ready(self, timeout_s: float = 30) -> None:
        metadata = [("authorization", f"Bearer {self._api_key}")] if self._api_key else None
        end = time.monotonic() + timeout_s
        with self.channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while True:
                self._check_alive(self.scheduler)
                status = stub.GetStatus(generation_pb2.GetStatusRequest(), timeout=2, metadata=metadata)
                if [e.state for e in status.executors] == ["READY"]:
                    return
                assert time.monotonic() < end, f"executor not READY: {status}"
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM both process groups, SIGKILL after 10 s."""
        children = [c for c in (self.scheduler, self.executor) if c.process is not None]
        for child in children:
            if child.process.poll() is None:
                os.killpg(child.process.pid, signal.SIGTERM)
        for child in children:
            try:
                child.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()


def open_channel(address: str, creds: grpc.ChannelCredentials | None, server_name: str = "") -> grpc.Channel:
    """A plaintext or TLS channel; `server_name` overrides the name checked in the certificate."""
    if creds is None:
        return grpc.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, creds, options=options)


def is_serving(address: str, creds: grpc.ChannelCredentials | None, server_name: str = "") -> bool:
    """One grpc.health.v1 Check of the overall status."""
    with open_channel(address, creds, server_name) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING
