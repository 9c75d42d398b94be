"""One executor over several ranks: the leader mirrors every runner call to the others, which follow.

The leader (rank 0) is the only rank the scheduler talks to. ``GroupLeader``
stands in for its runner in the servicer: each call that changes a runner
(a step, a reset, the warm-up, the constraints' tokenizer) is first shared
with every rank, then run locally; every rank runs the same call on the same
sequence state, meeting at the collectives inside it. The other ranks run
``follow``: take the leader's next call, run it, forever.

While the leader has nothing to send it shares a ping every few seconds, so a
follower that hears nothing for ``--group-timeout-s`` knows the leader is gone
(a dead leader's sockets usually say so at once). Any failure of a collective
ends the process (``collectives.fatal``), which takes the group down: it is
restarted as a whole (docs/parallel.md).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog

from executor_svc.lora.errors import LoraAdapterError
from executor_svc.parallel.collectives import GroupComm
from executor_svc.parallel.launch import LocalRanks
from executor_svc.parallel.shard import Placement
from executor_svc.runner.model_runner import ModelRunner
from pagoda.step import StepPlan, StepResult

log = structlog.get_logger(__name__)
# The calls a follower runs (what changes a runner's state or meets the others in collectives).
MIRRORED = ("execute", "reset", "warmup", "enable_constraints")
PING, STOP = "ping", "stop"


class GroupLeader:
    """Rank 0's runner as the servicer sees it: the local runner, with every mirrored call shared first."""

    def __init__(self, runner: ModelRunner, comm: GroupComm, ranks: list[dict[str, Any]], local: LocalRanks):
        self._runner = runner
        self._comm = comm
        self._local = local
        # What each rank reported when the group formed (rank, host, pid, shard, rss): `pagoda status`.
        self.ranks = ranks
        self._lock = threading.Lock()  # one call at a time is shared, and pings never interleave with one
        self._last_call = time.monotonic()
        self._closed = False
        self._ping_every_s = min(5.0, comm.timeout_s / 4)
        threading.Thread(target=self._ping, name="group-ping", daemon=True).start()

    def __getattr__(self, name: str) -> Any:  # info, config, kv_cache, model, ...: the local runner's
        return getattr(self._runner, name)

    @property
    def placement(self) -> Placement:
        """The group's shape (tensor x pipeline ranks) and the leader's place in it: Describe reports it."""
        return self._comm.placement

    def last_contact_s(self) -> float:
        """Seconds since the group last completed a call with every rank (a mirrored call or a ping): a leader
        that answers has every rank, and this says how recently they all met (`pagoda status`)."""
        return time.monotonic() - self._last_call

    def execute(self, step: StepPlan) -> StepResult:
        return self._mirror("execute", step)

    def reset(self) -> None:
        self._mirror("reset")

    def warmup(self) -> Any:
        return self._mirror("warmup")

    def enable_constraints(self, tokenizer_json: str, eos_token_ids: Any) -> None:
        self._mirror("enable_constraints", tokenizer_json, tuple(eos_token_ids))

    def add_lora(self, name: str, path: str) -> Any:
        raise LoraAdapterError("LoRA adapters are not served by an executor group yet (docs/parallel.md)")

    def remove_lora(self, name: str) -> int:
        raise LoraAdapterError(f"no LoRA adapter {name!r}: an executor group serves none (docs/parallel.md)")

    def lora_adapters(self) -> tuple[Any, ...]:
        return ()

    def close(self, timeout_s: float) -> None:
        """Tells the followers to exit (the leader is stopping in order) and waits up to ``timeout_s`` for its
        local ranks."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._local.stopping = True
            self._comm.share((STOP, ()), 0)
            self._comm.close()
        self._local.stop(timeout_s)
        log.info("group_stopped", world_size=self._comm.placement.world_size)

    def _mirror(self, method: str, *args: Any) -> Any:
        with self._lock:
            self._comm.share((method, args), 0)
            try:
                return getattr(self._runner, method)(*args)
            finally:
                self._last_call = time.monotonic()

    def _ping(self) -> None:
        while not self._closed:
            time.sleep(self._ping_every_s)
            if time.monotonic() - self._last_call < self._ping_every_s:
                continue
            if not self._lock.acquire(timeout=self._ping_every_s):
                continue  # a call is running: the followers are busy with it
            try:
                if not self._closed and time.monotonic() - self._last_call >= self._ping_every_s:
                    self._comm.share((PING, ()), 0)
                    self._last_call = time.monotonic()
            finally:
                self._lock.release()


def follow(runner: ModelRunner, comm: GroupComm) -> None:
    """A follower's loop: the leader's calls, in order, until it says stop (a lost leader ends the process)."""
    rank = comm.placement.rank
    log.info("group_rank_following", rank=rank)
    while True:
        method, args = comm.share(None, 0)
        if method == PING:
            continue
        if method == STOP:
            comm.close()
            log.info("group_rank_stopped", rank=rank)
            return
        if method not in MIRRORED:
            raise ValueError(f"the leader sent an unknown call {method!r}")
        getattr(runner, method)(*args)


def rank_report(comm: GroupComm, runner: ModelRunner) -> list[dict[str, Any]]:
    """Every rank's (rank, host, pid, shard, rss) on the leader; each rank calls it once, after loading."""
    import os
    import socket

    from executor_svc.loading.memory import rss_bytes

    mine = {
        "rank": comm.placement.rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "shard": runner.shard.describe() if runner.shard is not None else "",
        "rss_bytes": rss_bytes(),
        "kv_cache_bytes": runner.kv_cache.num_bytes,
    }
    return comm.gather(mine)
