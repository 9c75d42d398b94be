"""Whether a running system's KV pools are whole again: nothing running, every block free."""

from __future__ import annotations

import time
from typing import Any


def pool_is_whole(status: Any, *, nothing_waiting: bool = False) -> bool:
    """Of a client's ``ServerStatus``: no request running (nor waiting, if asked), every executor's blocks free."""
    idle = status.num_running == 0 and (status.num_waiting == 0 or not nothing_waiting)
    return idle and all(e.num_free_kv_blocks == e.num_kv_blocks for e in status.executors)


def wait_pool_whole(client: Any, timeout_s: float = 30.0, *, nothing_waiting: bool = False) -> None:
    """Polls ``client.status()`` until the pool is whole (``pool_is_whole``); fails after ``timeout_s``.

    It is whole within milliseconds of the last request's end on an idle machine; the default bound is for a
    loaded one (CI runs the suite on two busy cores), and it costs nothing when the pool is whole.
    """
    deadline = time.monotonic() + timeout_s
    while not pool_is_whole(status := client.status(), nothing_waiting=nothing_waiting):
        assert time.monotonic() < deadline, f"KV pool not whole after {timeout_s} s: {status}"
        time.sleep(0.05)
