"""Local launcher: N ``pagoda-executor`` processes and one ``pagoda-scheduler``.

Every child runs in its own process group on 127.0.0.1; ``Launcher`` waits
until all are healthy and stops them all (SIGTERM, then SIGKILL after a grace
period). ``pagoda serve`` and the integration tests use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc

from pagoda.channel import Tls, auth_metadata, open_channel
from pagoda.launch.health import ServingStatus, check_health
from pagoda.v1 import generation_pb2, generation_pb2_grpc

LOOPBACK = "127.0.0.1"
# A SIGKILLed process is gone within milliseconds unless stuck in the kernel (D state).
_KILL_WAIT_S = 10.0
logger = logging.getLogger(__name__)
# The generated stub is untyped; this is the one call the launcher makes through it.
_GenerationStub: Callable[[grpc.Channel], Any] = generation_pb2_grpc.GenerationStub


class LauncherError(RuntimeError):
    """A child failed to start or died; ``exit_code`` is its exit status."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def service_command(script: str, module: str) -> list[str]:
    """The console script next to ``sys.executable``, else ``python -m module``."""
    candidate = Path(sys.executable).parent / script
    if candidate.exists() and os.access(candidate, os.X_OK):
        return [str(candidate)]
    found = shutil.which(script)
    return [found] if found else [sys.executable, "-m", module]


@dataclass
class _Child:
    """One child process and how to restart it."""

    name: str
    argv: list[str]
    address: str
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None


class Launcher:
    """Start a local Pagoda system; use as a context manager.

    Args:
        model: checkpoint folder, ``.gguf`` file, or None for ``default``.
        num_executors: executor processes to start.
        port: scheduler port (0: a free port).
        host: scheduler bind address.
        dtype: executor ``--dtype`` (None: the executor's default).
        kv_cache_memory: executor ``--kv-cache-memory`` (e.g. ``"64MiB"``).
        block_size: executor ``--block-size``.
        metrics_port, http_port: scheduler ports (None: off).
        extra_executor_args, extra_scheduler_args: flags passed through.
        env: extra environment of every child.
        log_dir: write each child's output to ``log_dir/<name>.log``
            (None: inherit this process's stdout/stderr).
        startup_timeout_s: how long ``start`` waits for health.
        stop_grace_s: SIGTERM → SIGKILL grace per child.
        client_tls: TLS settings for the launcher's own calls to the
            scheduler when it serves TLS (``--tls-cert``/``--tls-key``).
        client_api_key: API key for the launcher's own calls when the
            scheduler requires keys.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        num_executors: int = 1,
        port: int = 0,
        host: str = LOOPBACK,
        dtype: str | None = None,
        kv_cache_memory: str | None = None,
        block_size: int | None = None,
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
    ) -> None:
        if num_executors < 1:
            raise ValueError("num_executors must be at least 1")
        self.port = port or free_port()
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.client_tls = client_tls
        self.client_api_key = client_api_key
        self._env = {**os.environ, **(env or {})}
        self.executors = [
            self._executor_child(i, model, dtype, kv_cache_memory, block_size, extra_executor_args)
            for i in range(num_executors)
        ]
        self.scheduler = self._scheduler_child(metrics_port, http_port, extra_scheduler_args)

    def _executor_child(
        self,
        index: int,
        model: str | None,
        dtype: str | None,
        kv_cache_memory: str | None,
        block_size: int | None,
        extra: Sequence[str],
    ) -> _Child:
        executor_port = free_port()
        argv = service_command("pagoda-executor", "executor_svc.main")
        argv += ["--host", LOOPBACK, "--port", str(executor_port), "--model", model or "default"]
        argv += _optional_flags({"--dtype": dtype, "--kv-cache-memory": kv_cache_memory, "--block-size": block_size})
        return _Child(f"executor-{index}", argv + list(extra), f"{LOOPBACK}:{executor_port}")

    def _scheduler_child(self, metrics_port: int | None, http_port: int | None, extra: Sequence[str]) -> _Child:
        argv = service_command("pagoda-scheduler", "scheduler_svc.main")
        argv += ["--host", self.host, "--port", str(self.port)]
        argv += ["--executors", ",".join(child.address for child in self.executors)]
        argv += _optional_flags({"--metrics-port": metrics_port, "--http-port": http_port})
        return _Child("scheduler", argv + list(extra), f"{LOOPBACK}:{self.port}")

    @property
    def target(self) -> str:
        """``host:port`` for clients."""
        host = LOOPBACK if self.host in ("0.0.0.0", "", "::") else self.host
        return f"{host}:{self.port}"

    @property
    def executor_pids(self) -> list[int]:
        """Process ids of the executors (0 for one not running)."""
        return [c.process.pid if c.process and c.process.poll() is None else 0 for c in self.executors]

    @property
    def scheduler_pid(self) -> int:
        """Process id of the scheduler."""
        return self.scheduler.process.pid if self.scheduler.process else 0

    @property
    def executor_addresses(self) -> list[str]:
        """``127.0.0.1:port`` of each executor."""
        return [c.address for c in self.executors]

    def start(self) -> Launcher:
        """Start every child and wait until all are healthy.

        Raises:
            LauncherError: a child exited, or health did not come in time
                (every child is stopped first).
        """
        try:
            for child in self.executors:
                self._spawn(child)
            self._wait_healthy(self.executors)
            self._spawn(self.scheduler)
            self._wait_healthy([self.scheduler], self.client_tls)
            self._wait_executors_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, child: _Child) -> None:
        output: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = open(self.log_dir / f"{child.name}.log", "ab")  # noqa: SIM115 (closed in _reap)
        child.log_file = output
        child.process = subprocess.Popen(
            child.argv,
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            start_new_session=True,
        )

    def _wait_healthy(self, children: Sequence[_Child], tls: Tls = False) -> None:
        """Poll each child's health Check until SERVING, up to ``startup_timeout_s``."""
        end = time.monotonic() + self.startup_timeout_s
        pending = list(children)
        logger.info("waiting up to %.0fs for %s to be SERVING", self.startup_timeout_s, [c.name for c in pending])
        while pending:
            self.raise_if_dead(children)
            pending = [c for c in pending if check_health(c.address, tls=tls) != ServingStatus.SERVING]
            if pending and time.monotonic() > end:
                names = ", ".join(c.name for c in pending)
                raise LauncherError(f"not healthy after {self.startup_timeout_s:.0f}s: {names}")
            if pending:
                time.sleep(0.2)

    def _wait_executors_ready(self) -> None:
        """Wait (bounded) until the scheduler reports every executor READY."""
        end = time.monotonic() + min(30.0, self.startup_timeout_s)
        logger.info("waiting up to %.0fs for the scheduler to report the executors READY", end - time.monotonic())
        states: list[str] | None = []
        with open_channel(self.target, self.client_tls) as channel:
            stub = _GenerationStub(channel)
            while time.monotonic() < end:
                self.raise_if_dead()
                states = self._executor_states(stub)
                if states is None or states.count("READY") >= len(self.executors):
                    return
                time.sleep(0.2)
        raise LauncherError(f"the scheduler did not report {len(self.executors)} executors READY: {states}")

    def _executor_states(self, stub: Any) -> list[str] | None:
        """Executor states from one ``GetStatus`` (2 s bound); None when the scheduler has no such RPC."""
        try:
            status = stub.GetStatus(
                generation_pb2.GetStatusRequest(), timeout=2.0, metadata=auth_metadata(self.client_api_key)
            )
        except grpc.RpcError as error:
            return None if error.code() == grpc.StatusCode.UNIMPLEMENTED else []
        return [e.state for e in status.executors]

    def dead_child(self, children: Sequence[_Child] | None = None) -> tuple[str, int] | None:
        """``(name, exit code)`` of the first child (of ``children``, default all) that has exited, or None."""
        for child in children if children is not None else [*self.executors, self.scheduler]:
            if child.process is not None and child.process.poll() is not None:
                return child.name, child.process.returncode
        return None

    def raise_if_dead(self, children: Sequence[_Child] | None = None) -> None:
        """Raise ``LauncherError`` (with the child's exit code) if one (of ``children``) exited."""
        dead = self.dead_child(children)
        if dead is not None:
            name, code = dead
            hint = f"; see {self.log_dir / (name + '.log')}" if self.log_dir else ""
            raise LauncherError(f"{name} exited with code {code}{hint}", exit_code=code or 1)

    def kill_executor(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to executor ``index``'s process group and reap it."""
        child = self.executors[index]
        if child.process is None:
            return
        _signal_group(child.process, sig)
        _reap(child.process, self.stop_grace_s)
        _close_log(child)

    def restart_executor(self, index: int, *, wait: bool = True) -> None:
        """Start executor ``index`` again on its port (killing it first if alive)."""
        child = self.executors[index]
        if child.process is not None and child.process.poll() is None:
            self.kill_executor(index)
        self._spawn(child)
        if wait:
            self._wait_healthy([child])

    def stop(self) -> None:
        """SIGTERM every child, SIGKILL what is left after the grace period."""
        processes = [(c, c.process) for c in [self.scheduler, *self.executors] if c.process is not None]
        for _, process in processes:
            _signal_group(process, signal.SIGTERM)
        end = time.monotonic() + self.stop_grace_s
        for child, process in processes:
            _reap(process, max(0.0, end - time.monotonic()))
            _close_log(child)

    def logs(self) -> dict[str, str]:
        """Each child's log text (only with ``log_dir``)."""
        if self.log_dir is None:
            return {}
        out = {}
        for child in [*self.executors, self.scheduler]:
            path = self.log_dir / f"{child.name}.log"
            out[child.name] = path.read_text(errors="replace") if path.exists() else ""
        return out

    def __enter__(self) -> Launcher:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _optional_flags(flags: Mapping[str, object]) -> list[str]:
    out: list[str] = []
    for flag, value in flags.items():
        if value is not None:
            out += [flag, str(value)]
    return out


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the child's process group (it leads its own session)."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _reap(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """Wait ``grace_s`` for the child to exit, then SIGKILL its group and wait (bounded) again."""
    try:
        process.wait(timeout=grace_s)
        return
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
    try:
        process.wait(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d still running %.0fs after SIGKILL; not reaped", process.pid, _KILL_WAIT_S)


def _close_log(child: _Child) -> None:
    if child.log_file is not None:
        child.log_file.close()
        child.log_file = None
