"""A real system (a scheduler and executors, started by ``Launcher``) on a model folder, for tests."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def fp32_launcher(model_dir: Path, log_dir: Path, kv_cache_memory: str = "256KiB", **options: Any) -> Any:
    """A ``Launcher`` of fp32 executors on ``model_dir``, logging into ``log_dir``; entering it starts the processes.

    ``options`` are the Launcher's own (``num_executors``, ``block_size``, ``http_port``,
    ``extra_scheduler_args``, ...); the start waits at most ``startup_timeout_s``, 120 s unless given.
    """
    from pagoda.launch.launcher import Launcher  # imported here: collecting the tests needs no launcher

    options.setdefault("startup_timeout_s", 120)
    return Launcher(str(model_dir), dtype="float32", kv_cache_memory=kv_cache_memory, log_dir=log_dir, **options)


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) inside the block and continued (SIGCONT) after, as a stalled machine would.

    Keep the block short, seconds at most: a scheduler sees a paused executor's heartbeats time out (it keeps
    driving it), and gRPC keepalive ends its stream after about 15 s without an answer.
    """
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
