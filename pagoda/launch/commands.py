"""The command lines of the launcher's children, their environment, and the ports they listen on."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagoda.runtime.ports import LOOPBACK, free_port


def service_command(script: str, module: str) -> list[str]:
    """The console script next to ``sys.executable``, else ``python -m module``."""
    candidate = Path(sys.executable).parent / script
    if candidate.exists() and os.access(candidate, os.X_OK):
        return [str(candidate)]
    found = shutil.which(script)
    return [found] if found else [sys.executable, "-m", module]


def optional_flags(flags: Mapping[str, object]) -> list[str]:
    """``--flag value`` for each flag whose value is not None."""
    out: list[str] = []
    for flag, value in flags.items():
        if value is not None:
            out += [flag, str(value)]
    return out


def scheduler_ports(port: int, num_schedulers: int) -> list[int]:
    """Consecutive ports from ``port``, or a free port each when ``port`` is 0."""
    if port:
        return [port + i for i in range(num_schedulers)]
    return [free_port() for _ in range(num_schedulers)]


def executor_argv(
    port: int,
    model: str | None,
    dtype: str | None,
    kv_cache_memory: str | None,
    block_size: int | None,
    extra: Sequence[str],
    kv_cache_dtype: str | None = None,
    quantization: str | None = None,
) -> list[str]:
    """``pagoda-executor`` on 127.0.0.1:``port``."""
    argv = service_command("pagoda-executor", "executor_svc.main")
    argv += ["--host", LOOPBACK, "--port", str(port), "--model", model or "default"]
    argv += optional_flags({"--dtype": dtype, "--kv-cache-memory": kv_cache_memory, "--block-size": block_size})
    argv += optional_flags({"--kv-cache-dtype": kv_cache_dtype})
    argv += optional_flags({"--quantization": quantization})
    return argv + list(extra)


@dataclass(frozen=True)
class OffloadPlan:
    """The executors' KV offload tiers (docs/kv-offload.md): executor i keeps its own in ``root/executor-<i>``.

    Attributes:
        root: the parent directory ("" = no disk tier, host memory only when ``memory`` is given).
        size, memory: each executor's disk and host-memory capacities (None: the executor's default).
        next_free: an ``executor-<i>`` another live process holds gives way to the first free
            ``executor-<i>.N`` (``pagoda serve``'s default root: two of them side by side never share).
    """

    root: str
    size: str | None = None
    memory: str | None = None
    next_free: bool = False

    def flags(self, index: int) -> list[str]:
        """The executor flags of executor ``index``."""
        argv = ["--kv-offload-dir", str(Path(self.root).expanduser() / f"executor-{index}")] if self.root else []
        argv += optional_flags({"--kv-offload-size": self.size, "--kv-offload-memory": self.memory})
        return argv + (["--kv-offload-dir-next-free"] if self.next_free and self.root else [])


@dataclass(frozen=True)
class SchedulerPlan:
    """What every scheduler of one system shares.

    Attributes:
        host: bind address.
        ports: one client-API port per scheduler.
        executor_addresses: every executor (each scheduler is given all of them).
        metrics_port, http_port: the first scheduler's; the i-th gets ``+ i`` (None: off).
        extra: flags passed through.
    """

    host: str
    ports: Sequence[int]
    executor_addresses: Sequence[str]
    metrics_port: int | None = None
    http_port: int | None = None
    extra: Sequence[str] = ()

    def name(self, index: int) -> str:
        """``scheduler`` when there is one, else ``scheduler-<index>``."""
        return "scheduler" if len(self.ports) == 1 else f"scheduler-{index}"

    def argv(self, index: int) -> list[str]:
        """``pagoda-scheduler`` number ``index``; ``--scheduler-id`` only when there are several."""
        argv = service_command("pagoda-scheduler", "scheduler_svc.main")
        argv += ["--host", self.host, "--port", str(self.ports[index])]
        argv += ["--executors", ",".join(self.executor_addresses)]
        argv += optional_flags(
            {
                "--metrics-port": _nth_port(self.metrics_port, index),
                "--http-port": _nth_port(self.http_port, index),
                "--scheduler-id": self.name(index) if len(self.ports) > 1 else None,
            }
        )
        return argv + list(self.extra)


def _nth_port(first: int | None, index: int) -> int | None:
    """The ``index``-th consecutive port from ``first`` (None and 0, meaning off, stay as they are)."""
    return first + index if first else first


def child_env(extra: Mapping[str, str] | None, *, echo: bool) -> dict[str, str]:
    """This environment plus ``extra``; console logs when the echoed output lands on a terminal."""
    env = {**os.environ, **(extra or {})}
    if echo and sys.stderr is not None and sys.stderr.isatty():
        env.setdefault("PAGODA_LOG_FORMAT", "console")
    return env
