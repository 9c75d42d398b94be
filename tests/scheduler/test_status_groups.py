"""GetStatus of an executor group: its sizes from its Describe, its ranks and last contact from its heartbeat, and
every rank's health unknown once the leader stops answering."""

from __future__ import annotations

import asyncio
import dataclasses

from support.executor_info import executor_info

from pagoda.launch.launcher import free_port
from pagoda.step import RANK_UNKNOWN, ExecutorInfo, GroupRank
from scheduler_svc.api.servicer import status_to_pb
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.fleet.executor_handle import ExecutorHandle

RANKS = (
    GroupRank(0, "vm", 1533, "layers 0-1, q heads 0-1, kv heads 0-0, vocab 0-191", 280 * 2**20, 2**21),
    GroupRank(1, "vm", 1820, "layers 0-1, q heads 2-3, kv heads 1-1, vocab 192-383", 274 * 2**20, 2**21),
)
GROUP = executor_info(kernels=(), tensor_parallel_size=2, pipeline_parallel_size=1, group_ranks=RANKS)
PLAIN = executor_info(kernels=(), tensor_parallel_size=1, pipeline_parallel_size=1, group_ranks=())


def _never_connects(info: ExecutorInfo) -> SchedulerConfig:
    raise AssertionError("the handles of this test are not started")


def _handle(engine: Engine, address: str, info: ExecutorInfo) -> ExecutorHandle:
    handle = ExecutorHandle(address, engine, _never_connects, step_timeout_s=1.0)
    handle.info = info
    engine.executors[address] = handle
    return handle


def test_status_carries_a_groups_sizes_ranks_and_last_contact():
    engine = Engine(SchedulerServiceConfig())
    group = _handle(engine, "10.0.0.1:50061", GROUP)
    group.group_ranks, group.group_last_contact_s = RANKS, 2.5  # as its last heartbeat gave them
    _handle(engine, "10.0.0.2:50061", PLAIN)
    got, plain = status_to_pb(engine).executors
    assert (got.tensor_parallel_size, got.pipeline_parallel_size, got.group_last_contact_s) == (2, 1, 2.5)
    rows = [(r.rank, r.host, r.pid, r.shard, r.rss_bytes, r.kv_cache_bytes, r.health) for r in got.group_ranks]
    assert rows == [dataclasses.astuple(r) for r in RANKS]
    assert (plain.tensor_parallel_size, plain.pipeline_parallel_size, list(plain.group_ranks)) == (1, 1, [])
    assert plain.group_last_contact_s == 0.0


def test_a_leader_that_does_not_answer_leaves_its_ranks_health_unknown():
    async def poll_nobody() -> ExecutorHandle:
        engine = Engine(SchedulerServiceConfig())
        handle = _handle(engine, f"127.0.0.1:{free_port()}", GROUP)  # nothing listens there
        handle.group_ranks = RANKS
        handle.start()
        try:
            await handle.poll("sched-a", draining=False)
        finally:
            await handle.stop()
        return handle

    handle = asyncio.run(poll_nobody())
    assert handle.state.value == "DEAD"
    assert [r.health for r in handle.group_ranks] == [RANK_UNKNOWN, RANK_UNKNOWN]
    assert [dataclasses.replace(r, health="ok") for r in handle.group_ranks] == list(RANKS)  # the last layout kept
