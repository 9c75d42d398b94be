"""GetStatus carries what each executor described (its state, the kernels it runs) and who holds its lease."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from support.executor_info import executor_info

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import ExecutorInfo
from pagoda.v1 import generation_pb2
from scheduler_svc.api.servicer import status_to_pb
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core.config import DraftSource
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.engine import Engine
from scheduler_svc.errors import Unavailable
from scheduler_svc.fleet.executor_handle import ExecutorHandle
from scheduler_svc.fleet.ownership import ExecutorView
from scheduler_svc.request import GenerationRequest, PromptInput

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


def _driven_engine() -> Engine:
    """One executor described, seen held by sched-b, with a scheduler core: 2 sequences running, 1 waiting, 4 of
    16 blocks used, 3 blocks in its offload tier; and every total counted."""
    engine = Engine(SchedulerServiceConfig(scheduler_id="sched-a"))
    handle = ExecutorHandle("10.0.0.1:50061", engine, _never_connects, step_timeout_s=1.0)
    handle.info = INFO
    handle.loras = {adapter.name: adapter for adapter in INFO.loras}  # as its Describe gives them
    handle.group_ranks, handle.group_last_contact_s = INFO.group_ranks, 0.5  # as its heartbeat gives them
    handle._set_view(ExecutorView(handle.address, True, "sched-b", 9, ("sched-a", "sched-b")))
    core = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=2, kv_offload=True), tier_hashes=(1, 2, 3)
    )
    for seq_id in range(3):
        core.add(SchedulerSequence(seq_id, f"r{seq_id}", [1, 2, 3, 4, 5, 6], SamplingParams(), StoppingCriteria()))
    core.schedule()
    handle.scheduler = core
    engine.executors[handle.address] = handle
    m = engine.metrics
    m.num_requests_total, m.num_preemptions_total, m.num_swaps_total = 11, 12, 13
    m.prefix_cache_queries_total, m.prefix_cache_hits_total, m.offload_hit_tokens_total = 14, 15, 16
    m.spec_totals = {DraftSource.NGRAM: (1, 2, 3), DraftSource.MODEL: (10, 20, 30)}
    return engine


def test_status_of_a_driven_executor_comes_from_its_core_and_its_describe():
    status = status_to_pb(_driven_engine())
    (e,) = status.executors
    assert (e.num_running, e.num_waiting, e.num_kv_blocks, e.num_free_kv_blocks) == (2, 1, 16, 12)
    assert (e.kv_cache_usage, e.num_tier_blocks, e.lease_holder, e.lease_epoch) == (0.25, 3, "sched-b", 9)
    described = (e.incarnation_id, e.kv_offload, e.kv_cache_dtype, e.quantization, e.draft_model)
    assert described == ("inc-1", "kv_offload", "kv_cache_dtype", "quantization", "draft_model")
    assert (status.num_running, status.num_waiting, status.kv_cache_usage) == (2, 1, 0.25)
    totals = (status.num_requests_total, status.num_preemptions_total, status.num_swaps_total)
    assert totals == (11, 12, 13)
    prefix = (status.prefix_cache_queries_total, status.prefix_cache_hits_total, status.offload_hit_tokens_total)
    assert prefix == (14, 15, 16)
    spec = (status.spec_num_drafts_total, status.spec_draft_tokens_total, status.spec_accepted_tokens_total)
    spec_model = (
        status.spec_model_num_drafts_total,
        status.spec_model_draft_tokens_total,
        status.spec_model_accepted_tokens_total,
    )
    assert (spec, spec_model) == ((11, 22, 33), (10, 20, 30))


@pytest.mark.parametrize("message", [generation_pb2.ServerStatus, generation_pb2.ExecutorStatus])
def test_the_scheduler_fills_every_status_field(message):
    """A field added to the proto and not filled here reads as its zero value: this names it."""
    status = status_to_pb(_driven_engine())
    pb = status if message is generation_pb2.ServerStatus else status.executors[0]
    unfilled = {f.name for f in message.DESCRIPTOR.fields} - {f.name for f, _ in pb.ListFields()}
    assert not unfilled, f"GetStatus leaves {sorted(unfilled)} unset"


async def _serves(engine: Engine) -> bool:
    try:
        await anext(engine.generate(_request()))
    except Unavailable as exc:
        return "holds no executor" not in str(exc)
    return True


def _request() -> GenerationRequest:
    return GenerationRequest(request_id="r", prompt=PromptInput(token_ids=(1, 2, 3)))
