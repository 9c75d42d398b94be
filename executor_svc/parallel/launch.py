"""Starting a process's share of an executor group: its extra local ranks as child processes, then its own rank.

A process runs ``--group-local-ranks`` ranks: itself as ``--group-rank`` and
the next ones as children, started with the same flags plus their rank (and
the resolved model path, so no child prepares the model again). A child dies
with its parent (PR_SET_PDEATHSIG, set by the child: no fork hooks run in the
parent, whose gRPC threads are live), and a child that exits takes its parent
down (``watch``): the group is one unit, restarted whole by whoever supervises
it (``pagoda serve``, Kubernetes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

import structlog

from executor_svc.config import ExecutorConfig
from executor_svc.parallel.collectives import fatal
from executor_svc.parallel.shard import Placement
from pagoda.runtime.ports import LOOPBACK, free_port

log = structlog.get_logger(__name__)
_PR_SET_PDEATHSIG = 1
# Set in a local rank's environment (to its parent's pid): it dies with its parent.
CHILD_ENV = "PAGODA_GROUP_PARENT_PID"


def placement(config: ExecutorConfig, rank: int | None = None) -> Placement:
    """The place of ``rank`` (this process's first one by default) in the configured group."""
    rank = config.group_rank if rank is None else rank
    return Placement(rank, config.tensor_parallel_size, config.pipeline_parallel_size)


def group_address(config: ExecutorConfig) -> str:
    """The group's rendezvous: the flag's, else (every rank local) 127.0.0.1 and a port free right now."""
    if config.group_address:
        return config.group_address
    return f"{LOOPBACK}:{free_port()}"


class LocalRanks:
    """The child processes running this process's other ranks."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def start(
        self, config: ExecutorConfig, argv: Sequence[str], address: str, model_path: str, draft_path: str | None
    ) -> None:
        """Starts ranks group_rank + 1 .. group_rank + local_ranks - 1 (run from the main thread: a child's
        death signal follows the thread that started it). Each gets this process's share of the cores."""
        first = config.group_rank
        threads = threads_per_rank(config)
        env = {**os.environ, CHILD_ENV: str(os.getpid())}
        for rank in range(first + 1, first + config.local_ranks):
            flags = ["--group-rank", str(rank), "--group-local-ranks", "1", "--group-address", address]
            flags += ["--model", model_path, "--num-threads", str(threads)]
            flags += ["--draft-model", draft_path] if draft_path else []
            command = [sys.executable, "-m", "executor_svc.main", *argv, *flags]
            self.procs[rank] = subprocess.Popen(command, env=env)
            log.info("group_rank_started", rank=rank, pid=self.procs[rank].pid)
        for rank, proc in self.procs.items():
            threading.Thread(target=self._watch, args=(rank, proc), name=f"rank-{rank}", daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self.stopping:
            fatal(f"group rank {rank} (pid {proc.pid}) exited with status {code}")

    def stop(self, timeout_s: float) -> None:
        """Waits for the children to exit after the leader told them to stop; kills the ones that do not."""
        self.stopping = True
        for rank, proc in self.procs.items():
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("group_rank_killed", rank=rank, pid=proc.pid, waited_s=timeout_s)
                proc.kill()


def become_follower() -> None:
    """In a rank other than the leader: leave SIGINT and SIGTERM to the leader (it drains the group, then tells
    every rank to stop; a leader that is gone ends the rank through its collectives); a rank started by
    ``LocalRanks`` also dies with its parent (SIGKILL when it dies, whatever the reason)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.environ.get(CHILD_ENV)
    if not parent:
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        fatal(f"the parent rank (pid {parent}) is gone")


def threads_per_rank(config: ExecutorConfig) -> int:
    """Intra-op threads of each of this process's ranks: the flag's, else the cores shared among them."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.local_ranks)
