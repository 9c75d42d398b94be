"""A real system (a scheduler and executors, started by ``Launcher``) on a model folder, for tests."""

from __future__ import annotations

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
