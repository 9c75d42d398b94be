"""Local launcher: M ``pagoda-executor`` processes and N ``pagoda-scheduler`` processes.

Every child runs in its own process group on 127.0.0.1 (``child.Child``).
``Launcher.start`` waits until all are healthy; a child that exits before that
fails the start (a wrong flag or model path does not heal by retrying). After
that, with ``restart=True``, a ``Supervisor`` restarts a child that exits (same
command, same port) and gives up on a crash loop. ``stop`` drains the
schedulers first, then the executors (SIGTERM, SIGKILL after a grace period).
``pagoda serve`` and the integration tests use it.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from pagoda.channel import Tls, auth_metadata, open_channel
from pagoda.launch.child import Child, describe_exit
from pagoda.launch.commands import (
    OffloadPlan,
    SchedulerPlan,
    child_env,
    executor_argv,
    scheduler_ports,
    service_command,
)
from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.restart_policy import RestartPolicy
from pagoda.launch.supervisor import CRASH_LOOP_LINES, Supervisor
from pagoda.runtime.ports import LOOPBACK, free_port
from pagoda.v1 import generation_pb2, generation_pb2_grpc

__all__ = ["LOOPBACK", "Launcher", "LauncherError", "OffloadPlan", "free_port", "service_command"]

logger = logging.getLogger(__name__)
# The generated stub is untyped; this is the one call the launcher makes through it.
_GenerationStub: Callable[[grpc.Channel], Any] = generation_pb2_grpc.GenerationStub
_HEALTH_TIMEOUT_S = 1.0


class LauncherError(RuntimeError):
    """A child failed to start, died, or crash-looped; ``exit_code`` is for the shell."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Launcher:
    """Start a local Pagoda system; use as a context manager.

    Args:
        model: checkpoint folder, ``.gguf`` file, or None for ``default``.
        num_executors: executor processes to start.
        num_schedulers: scheduler processes, on consecutive ports from ``port``;
            each is given every executor (and ``--scheduler-id`` when several).
        port: first scheduler's port (0: a free port for each).
        host: scheduler bind address.
        dtype, kv_cache_memory, block_size, kv_cache_dtype, quantization: executor flags (None: its default).
        metrics_port, http_port: first scheduler's ports (None: off).
        extra_executor_args, extra_scheduler_args: flags passed through.
        env: extra environment of every child.
        log_dir: write each child's output to ``log_dir/<name>.log``
            (None: echo it to this process's stderr).
        startup_timeout_s: how long ``start`` waits for health.
        stop_grace_s: SIGTERM → SIGKILL grace per group (schedulers, then executors).
        client_tls, client_api_key: for the launcher's own calls to schedulers
            that serve TLS or require keys.
        restart: restart a child that exits after ``start`` (False: it stays
            down, ``check`` reports it).
        restart_policy: backoff and crash-loop rules of ``restart``.
        kv_offload: the executors' KV offload tiers (None: none, unless ``extra_executor_args`` give one).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        num_executors: int = 1,
        num_schedulers: int = 1,
        port: int = 0,
        host: str = LOOPBACK,
        dtype: str | None = None,
        kv_cache_memory: str | None = None,
        block_size: int | None = None,
        kv_cache_dtype: str | None = None,
        quantization: str | None = None,
        metrics_port: int | None = None,
        http_port: int | None = None,
        extra_executor_args: Sequence[str] = (),
        extra_scheduler_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_dir: str | Path | None = None,
        startup_timeout_s: float = 300.0,
        stop_grace_s: float = 10.0,
        client_tls: Tls = False,
        client_api_key: str | None = None,
        restart: bool = False,
        restart_policy: RestartPolicy | None = None,
        kv_offload: OffloadPlan | None = None,
    ) -> None:
        if num_executors < 1 or num_schedulers < 1:
            raise ValueError("num_executors and num_schedulers must be at least 1")
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.client_tls = client_tls
        self.client_api_key = client_api_key
        self._env = child_env(env, echo=self.log_dir is None)
        self.kv_offload = kv_offload
        self.executors = [
            self._child(
                f"executor-{i}",
                executor_argv(
                    p,
                    model,
                    dtype,
                    kv_cache_memory,
                    block_size,
                    [*self._offload_flags(i), *extra_executor_args],
                    kv_cache_dtype,
                    quantization,
                ),
                p,
            )
            for i, p in enumerate(free_port() for _ in range(num_executors))
        ]
        plan = SchedulerPlan(
            host,
            scheduler_ports(port, num_schedulers),
            self.executor_addresses,
            metrics_port,
            http_port,
            extra_scheduler_args,
        )
        # A lone scheduler is up once it serves; one of several may rightly hold no executor (NOT_SERVING).
        up = {ServingStatus.SERVING} | ({ServingStatus.NOT_SERVING} if num_schedulers > 1 else set())
        self.ports = list(plan.ports)
        self.schedulers = [
            self._child(plan.name(i), plan.argv(i), p, frozenset(up), client_tls) for i, p in enumerate(plan.ports)
        ]
        policy = restart_policy or RestartPolicy()
        self.supervisor = (
            Supervisor(self.children, policy=policy, is_healthy=self._is_healthy, slow_start_s=startup_timeout_s)
            if restart
            else None
        )

    def _offload_flags(self, index: int) -> list[str]:
        return self.kv_offload.flags(index) if self.kv_offload is not None else []

    def _child(
        self,
        name: str,
        argv: list[str],
        port: int,
        healthy: frozenset[ServingStatus] = frozenset({ServingStatus.SERVING}),
        tls: Tls = False,
    ) -> Child:
        address = f"{LOOPBACK}:{port}"
        return Child(name, argv, address, env=self._env, log_dir=self.log_dir, healthy_statuses=healthy, tls=tls)

    # ----- what tests and ``pagoda serve`` read ------------------------------

    @property
    def port(self) -> int:
        """The first scheduler's port."""
        return self.ports[0]

    @property
    def scheduler(self) -> Child:
        """The first scheduler."""
        return self.schedulers[0]

    @property
    def children(self) -> list[Child]:
        """Schedulers first, then executors."""
        return [*self.schedulers, *self.executors]

    @property
    def targets(self) -> list[str]:
        """``host:port`` of each scheduler, for clients."""
        host = LOOPBACK if self.host in ("0.0.0.0", "", "::") else self.host
        return [f"{host}:{port}" for port in self.ports]

    @property
    def target(self) -> str:
        """``host:port`` of the first scheduler."""
        return self.targets[0]

    @property
    def executor_pids(self) -> list[int]:
        """Process ids of the executors (0 for one not running)."""
        return [child.pid for child in self.executors]

    @property
    def scheduler_pids(self) -> list[int]:
        """Process ids of the schedulers (0 for one not running)."""
        return [child.pid for child in self.schedulers]

    @property
    def scheduler_pid(self) -> int:
        """Process id of the first scheduler."""
        return self.scheduler.pid

    @property
    def executor_addresses(self) -> list[str]:
        """``127.0.0.1:port`` of each executor."""
        return [child.address for child in self.executors]

    # ----- start ---------------------------------------------------------------

    def start(self) -> Launcher:
        """Start every child, wait until all are healthy, then supervise (with ``restart``).

        Raises:
            LauncherError: a child exited, or health did not come in time
                (every child is stopped first).
        """
        try:
            for child in self.executors:
                child.spawn()
            self._wait_healthy(self.executors)
            for child in self.schedulers:
                child.spawn()
            self._wait_healthy(self.schedulers)
            self._wait_executors_ready()
        except BaseException:
            self.stop()
            raise
        if self.supervisor is not None:
            self.supervisor.start()
        return self

    def _is_healthy(self, child: Child) -> bool:
        return check_health(child.address, tls=child.tls, timeout=_HEALTH_TIMEOUT_S) in child.healthy_statuses

    def _is_serving(self, child: Child) -> bool:
        return check_health(child.address, tls=child.tls, timeout=_HEALTH_TIMEOUT_S) == ServingStatus.SERVING

    def _wait_healthy(self, children: Sequence[Child], timeout_s: float | None = None) -> None:
        """Poll each child's health Check until it is up, bounded by ``timeout_s`` (default: startup)."""
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + timeout_s
        pending = list(children)
        logger.info("waiting up to %.0fs for %s to be healthy", timeout_s, [c.name for c in pending])
        while pending:
            self.check(children)
            pending = [c for c in pending if not self._is_healthy(c)]
            if pending and time.monotonic() > end:
                names = ", ".join(c.name for c in pending)
                raise LauncherError(f"not healthy after {timeout_s:.0f}s: {names}")
            if pending:
                time.sleep(0.2)

    def _wait_executors_ready(self) -> None:
        """Wait (bounded) until the schedulers together report every executor READY."""
        end = time.monotonic() + min(30.0, self.startup_timeout_s)
        logger.info("waiting up to %.0fs for the schedulers to report the executors READY", end - time.monotonic())
        ready: set[str] | None = set()
        while time.monotonic() < end:
            self.check()
            ready = self._ready_executors()
            if ready is None or len(ready) >= len(self.executors):
                return
            time.sleep(0.2)
        raise LauncherError(f"the schedulers did not report {len(self.executors)} executors READY: {ready}")

    def _ready_executors(self) -> set[str] | None:
        """Addresses some scheduler reports READY; None when the schedulers have no ``GetStatus``."""
        ready: set[str] = set()
        for child in self.schedulers:
            with open_channel(child.address, self.client_tls) as channel:
                try:
                    status = _GenerationStub(channel).GetStatus(
                        generation_pb2.GetStatusRequest(), timeout=2.0, metadata=auth_metadata(self.client_api_key)
                    )
                except grpc.RpcError as error:
                    if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                        return None
                    continue
            ready |= {e.address for e in status.executors if e.state == "READY"}
        return ready

    def wait_restarted(self, child: Child, old_pid: int, timeout_s: float = 120.0, *, serving: bool = False) -> int:
        """Wait (bounded) until the supervisor has restarted ``child`` and it is healthy; its new pid.

        Args:
            child: one of ``children``.
            old_pid: its pid before it died.
            timeout_s: the bound.
            serving: require SERVING (one of several schedulers is otherwise
                up while NOT_SERVING, before it holds an executor again).

        Raises:
            LauncherError: a crash loop, or not back within ``timeout_s``.
        """
        end = time.monotonic() + timeout_s
        logger.info(
            "waiting up to %.0fs for %s (was pid %d) to be restarted and healthy", timeout_s, child.name, old_pid
        )
        while time.monotonic() < end:
            self.check([])
            pid = child.pid
            if pid not in (0, old_pid) and (self._is_serving(child) if serving else self._is_healthy(child)):
                return pid
            time.sleep(0.1)
        raise LauncherError(f"{child.name} not restarted and healthy within {timeout_s:.0f}s")

    # ----- failures --------------------------------------------------------------

    def dead_child(self, children: Sequence[Child] | None = None) -> tuple[str, int] | None:
        """``(name, exit status)`` of the first child (of ``children``, default all) that has exited, or None."""
        for child in self.children if children is None else children:
            returncode = child.poll()
            if returncode is not None:
                return child.name, returncode
        return None

    def raise_if_dead(self, children: Sequence[Child] | None = None) -> None:
        """Raise ``LauncherError`` (with the child's exit code and last lines) if one (of ``children``) exited."""
        dead = self.dead_child(children)
        if dead is None:
            return
        name, returncode = dead
        child = next(c for c in self.children if c.name == name)
        child.join_output()
        what = f"exited with code {returncode}" if returncode >= 0 else f"was killed by {describe_exit(returncode)}"
        hint = f"; see {child.log_path}" if child.log_path else ""
        lines = [f"  | {line}" for line in child.last_lines(CRASH_LOOP_LINES)]
        message = "\n".join([f"{name} {what}{hint}", *(["Last log lines:", *lines] if lines else [])])
        raise LauncherError(message, exit_code=returncode if returncode > 0 else 1)

    def check(self, children: Sequence[Child] | None = None) -> None:
        """Raise ``LauncherError`` if the system failed: a crash loop, or (while
        not supervised) a child (of ``children``, default all) that exited."""
        crash = self.supervisor.crash_loop if self.supervisor is not None else None
        if crash is not None:
            raise LauncherError(crash.message(), exit_code=crash.returncode if crash.returncode > 0 else 1)
        if self.supervisor is None or not self.supervisor.running:
            self.raise_if_dead(children)

    # ----- stop and restart on purpose -------------------------------------------

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        """Stop ``child`` on purpose (it is not restarted): ``sig`` to its group, then reap it."""
        if self.supervisor is not None:
            self.supervisor.unwatch(child)
        child.signal(sig)
        child.reap(self.stop_grace_s)
        child.join_output()

    def restart(self, child: Child, *, wait: bool = True) -> None:
        """Start ``child`` again on its port (killing it first if alive); supervised again."""
        if self.supervisor is not None:
            self.supervisor.unwatch(child)  # no restart of its own meanwhile
        if child.poll() is None and child.process is not None:
            self.kill(child)
        child.spawn()
        if self.supervisor is not None:
            self.supervisor.watch(child)
        if wait:
            self._wait_healthy([child])

    def kill_executor(self, index: int, sig: int = signal.SIGKILL) -> None:
        """``kill`` executor ``index``."""
        self.kill(self.executors[index], sig)

    def restart_executor(self, index: int, *, wait: bool = True) -> None:
        """``restart`` executor ``index``."""
        self.restart(self.executors[index], wait=wait)

    def stop(self) -> None:
        """Stop supervising; SIGTERM the schedulers (they drain) and wait, then the executors."""
        if self.supervisor is not None:
            self.supervisor.stop()
        for group in (self.schedulers, self.executors):
            running = [c for c in group if c.process is not None]
            for child in running:
                child.signal(signal.SIGTERM)
            end = time.monotonic() + self.stop_grace_s
            for child in running:
                child.reap(max(0.0, end - time.monotonic()))
                child.join_output()

    def logs(self) -> dict[str, str]:
        """Each child's log text (only with ``log_dir``)."""
        out = {}
        for child in self.children:
            path = child.log_path
            if path is not None:
                out[child.name] = path.read_text(errors="replace") if path.exists() else ""
        return out

    def __enter__(self) -> Launcher:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
