"""The tier's writer: one background thread storing the blocks a step handed over, in order.

A step never waits for it: the store bounds what is queued (in bytes) and
drops a block rather than block the step; the writer stores the rest as fast as
the tiers take them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("executor")


@dataclasses.dataclass
class SaveItem:
    """One block to store: its identity, its bytes (host), and the event its copy-out ends with (CUDA)."""

    block_hash: int
    token_ids: tuple[int, ...]
    # [block_nbytes] uint8 on the host (pinned on CUDA); never written after the step hands it over.
    row: Any
    # torch.cuda.Event recorded after the device-to-host copy; None on the CPU.
    ready: Any = None


class BlockWriter:
    """A queue of SaveItems and the thread that passes each to ``sink``."""

    def __init__(self, sink: Callable[[SaveItem], None]) -> None:
        self._sink = sink
        self._queue: collections.deque[SaveItem] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-offload-writer", daemon=True)
        self._thread.start()

    def put(self, item: SaveItem) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the tier writer is closed")
            self._queue.append(item)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Waits until everything queued is stored, at most timeout_s; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
        return True

    def close(self, timeout_s: float) -> bool:
        """Stores what is queued (at most timeout_s), then stops the thread; False if blocks were left."""
        log.info("kv_offload_flushing", num_queued=len(self._queue), timeout_s=timeout_s)
        flushed = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            left = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=max(timeout_s, 1.0))
        if not flushed:
            log.warning("kv_offload_flush_timeout", num_dropped=left, timeout_s=timeout_s)
        return flushed

    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait(1.0)  # idle: waiting for a block to store
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                self._sink(item)
            except Exception:  # a failing store must not end the thread
                log.exception("kv_offload_store_failed", block_hash=f"{item.block_hash:016x}")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


# The writer's nice value: on a machine whose cores the model's threads keep busy, it takes the time they leave
# (blocks wait in the bounded queue meanwhile) instead of descheduling one of them mid-step.
WRITER_NICE = 10


def _lower_priority() -> None:
    """Lowers this thread's scheduling priority (Linux: per thread); elsewhere nothing."""
    with contextlib.suppress(AttributeError, OSError):  # platforms without per-thread priorities
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
