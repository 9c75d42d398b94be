"""Driving a real executor by hand, as a scheduler does: take its lease, then stream plans with the lease's epoch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc

from pagoda.v1 import executor_pb2, executor_pb2_grpc

SCHEDULER_ID_KEY = "x-pagoda-scheduler-id"
EPOCH_KEY = "x-pagoda-epoch"


def acquire(channel: grpc.Channel, scheduler_id: str) -> executor_pb2.Lease:
    """One Acquire call (10 s bound)."""
    return executor_pb2_grpc.ExecutorStub(channel).Acquire(
        executor_pb2.AcquireRequest(scheduler_id=scheduler_id), timeout=10
    )


def execute(
    channel: grpc.Channel,
    plans: Iterable[executor_pb2.StepPlan],
    scheduler_id: str,
    epoch: int,
    timeout: float = 60,
    stamp: bool = True,
) -> Iterator[executor_pb2.StepResult]:
    """An Execute stream naming lease (`scheduler_id`, `epoch`), each plan stamped with `epoch` (unless not `stamp`)."""

    def stamped() -> Iterator[executor_pb2.StepPlan]:
        for plan in plans:
            if stamp:
                plan.epoch = epoch
            yield plan

    metadata = ((SCHEDULER_ID_KEY, scheduler_id), (EPOCH_KEY, str(epoch)))
    return executor_pb2_grpc.ExecutorStub(channel).Execute(stamped(), timeout=timeout, metadata=metadata)


def leased_execute(
    channel: grpc.Channel, plans: Iterable[executor_pb2.StepPlan], scheduler_id: str = "test-driver"
) -> list[executor_pb2.StepResult]:
    """Acquire the lease, run `plans` on one stream, return every result (the lease ends with the stream)."""
    lease = acquire(channel, scheduler_id)
    assert lease.granted, f"the executor is held by {lease.holder_id} at epoch {lease.epoch}"
    return list(execute(channel, plans, scheduler_id, lease.epoch))
