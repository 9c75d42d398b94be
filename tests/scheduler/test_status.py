"""GetStatus carries what each executor described (its state, the kernels it runs) and who holds its lease."""

from __future__ import annotations

import asyncio
import dataclasses

from support.executor_info import executor_info

from pagoda.step import ExecutorInfo
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.errors import Unavailable
from scheduler_svc.executor_handle import ExecutorHandle
from scheduler_svc.ownership import ExecutorView
from scheduler_svc.request import GenerationRequest, PromptInput
from scheduler_svc.scheduler import SchedulerConfig
from scheduler_svc.server import status_to_pb

INFO = executor_info(incarnation_id="inc-1", kernels=(("attention", "cpp"), ("gemm", "amx-panel")))


def _never_connects(info: ExecutorInfo) -> SchedulerConfig:
    raise AssertionError("the handles of this test are not started")


def test_status_reports_each_executors_kernels():
    engine = Engine(SchedulerServiceConfig())
    for address, info in (("10.0.0.1:50061", INFO), ("10.0.0.2:50061", dataclasses.replace(INFO, kernels=()))):
        handle = ExecutorHandle(address, engine, _never_connects, step_timeout_s=1.0)
        handle.info = info
        engine.executors[address] = handle
    handle = ExecutorHandle("10.0.0.3:50061", engine, _never_connects, step_timeout_s=1.0)
    engine.executors[handle.address] = handle  # not described yet
    status = {e.address: e for e in status_to_pb(engine).executors}
    assert dict(status["10.0.0.1:50061"].kernels) == {"attention": "cpp", "gemm": "amx-panel"}
    assert status["10.0.0.1:50061"].incarnation_id == "inc-1"
    assert dict(status["10.0.0.2:50061"].kernels) == {}
    assert (status["10.0.0.3:50061"].state, dict(status["10.0.0.3:50061"].kernels)) == ("CONNECTING", {})


def test_status_names_this_scheduler_and_who_holds_each_executor():
    engine = Engine(SchedulerServiceConfig(scheduler_id="sched-a"))
    engine.fleet.ownership.decide(
        [ExecutorView("10.0.0.1:50061", True, "sched-b", 9, ("sched-a", "sched-b"))], set(), 0
    )
    seen = ExecutorHandle("10.0.0.1:50061", engine, _never_connects, step_timeout_s=1.0)
    seen._set_view(ExecutorView(seen.address, True, "sched-b", 9, ("sched-a", "sched-b")))
    free = ExecutorHandle("10.0.0.2:50061", engine, _never_connects, step_timeout_s=1.0)
    free._set_view(ExecutorView(free.address, True, "", 4, ("sched-a",)))
    gone = ExecutorHandle("10.0.0.3:50061", engine, _never_connects, step_timeout_s=1.0)
    gone._set_view(ExecutorView(gone.address, reachable=False))
    for handle in (seen, free, gone):
        engine.executors[handle.address] = handle
    status = status_to_pb(engine)
    assert (status.scheduler_id, list(status.schedulers)) == ("sched-a", ["sched-a", "sched-b"])
    rows = [(e.state, e.lease_holder, e.lease_epoch) for e in status.executors]
    assert rows == [("HELD_BY_OTHER", "sched-b", 9), ("FREE", "", 4), ("DEAD", "", 0)]
    assert not asyncio.run(_serves(engine)), "holding nothing, with another scheduler live"


async def _serves(engine: Engine) -> bool:
    try:
        await anext(engine.generate(_request()))
    except Unavailable as exc:
        return "holds no executor" not in str(exc)
    return True


def _request() -> GenerationRequest:
    return GenerationRequest(request_id="r", prompt=PromptInput(token_ids=(1, 2, 3)))
