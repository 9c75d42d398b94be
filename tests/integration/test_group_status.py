"""``pagoda status`` of a real executor group (tensor parallel 2 on the tiny model) behind a real scheduler: every
rank's process, shard and health, live; a rank killed from outside takes the group down and its ranks' health
becomes unknown."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from support.services import executor_service, scheduler_service, wait_until

from executor_svc.parallel.collectives import GROUP_LOST_EXIT
from pagoda_client import Client, ExecutorStatus
from pagoda_client.cli import main

pytestmark = pytest.mark.integration


@pytest.fixture
def group(tiny_model_dir, tmp_path):
    """A 2-rank executor group (its leader starts rank 1 as a child) and a scheduler over it."""
    executor = executor_service("group", tiny_model_dir, tmp_path, ["--tensor-parallel-size", "2"])
    scheduler = scheduler_service("sched-a", [executor], tmp_path)
    try:
        executor.start().wait_serving()
        scheduler.start().wait_serving()
        yield executor, scheduler
    finally:
        scheduler.stop()
        executor.stop()


def _executor(scheduler) -> ExecutorStatus:
    with Client(scheduler.address, timeout=5, max_retries=0) as client:
        (executor,) = client.status().executors
    return executor


def _parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def test_status_shows_each_rank_of_a_group_and_its_health(group, capsys):
    executor, scheduler = group
    wait_until(lambda: _executor(scheduler).state == "READY", 30, "the scheduler to drive the group", executor)
    status = _executor(scheduler)
    assert (status.tensor_parallel_size, status.pipeline_parallel_size) == (2, 1)
    leader, follower = status.group_ranks
    assert (leader.rank, leader.pid, follower.rank) == (0, executor.pid, 1)
    assert _parent_pid(follower.pid) == executor.pid  # a local rank: the leader's child
    assert leader.shard.startswith("layers 0-1, q heads 0-1") and follower.shard.startswith("layers 0-1, q heads 2-3")
    assert leader.rss_bytes > 0 and leader.kv_cache_bytes > 0 and follower.kv_cache_bytes == leader.kv_cache_bytes
    assert (leader.health, follower.health) == ("ok", "ok")
    first = status.group_last_contact_s
    assert first >= 0.0
    # Live: each heartbeat reads the leader's clock anew (no start-time copy).
    wait_until(lambda: _executor(scheduler).group_last_contact_s != first, 10, "a newer last contact", executor)

    assert main(["status", "--target", scheduler.address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  group: tensor 2 x pipeline 1  last contact ") for line in lines)
    rank_line = f"  rank 1  {follower.host}  pid {follower.pid}  {follower.shard}  rss "
    assert [line.endswith("  ok") for line in lines if line.startswith(rank_line)] == [True]

    os.kill(follower.pid, signal.SIGKILL)  # as the kernel's OOM killer would
    assert executor.process.wait(timeout=30) == GROUP_LOST_EXIT
    # The next heartbeat finds no leader: every rank's health is unknown, the last layout kept.
    wait_until(lambda: _healths(scheduler) == ["unknown", "unknown"], 15, "the heartbeat to find no leader")
    gone = _executor(scheduler)
    assert gone.state == "DEAD" and [r.pid for r in gone.group_ranks] == [executor.pid, follower.pid]


def _healths(scheduler) -> list[str]:
    return [r.health for r in _executor(scheduler).group_ranks]
