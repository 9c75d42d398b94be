"""GetStatus carries what each executor described: its state and the kernels it runs."""

from __future__ import annotations

import dataclasses

from support.executor_info import executor_info

from pagoda.step import ExecutorInfo
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.executor_handle import ExecutorHandle
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
