"""The tracer and the drafter keep per-sequence state by seq_id: it lives as long as the request, no longer.

The Engine runs for real with tracing on (an in-memory SDK) and n-gram speculation, over the scripted executor
of test_resume; requests end every way an engine sees (length, stop string, a cancelled stream, an executor lost).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from scheduler.test_resume import INFO, PROMPT, SCRIPT, ScriptedExecutor, System, _generate

from pagoda import tracing
from pagoda.step import FinishReason
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.fleet.executor_handle import ExecutorHandle, ExecutorState
from scheduler_svc.obs.request_trace import RequestTracer
from scheduler_svc.request import GenerationRequest, PromptInput, RequestOutput

# Repeats of the prompt make n-gram matches likely, so drafts are planned (and the scripted executor rejects them).
REPEATING_PROMPT = PROMPT * 3


def _traced_system() -> tuple[System, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = Engine(SchedulerServiceConfig(max_new_tokens=200), tracer=RequestTracer(provider.get_tracer("test")))
    config = SchedulerConfig(
        num_blocks=INFO.num_kv_blocks, block_size=INFO.block_size, eos_token_ids=(0,), speculative="ngram"
    )
    handle = ExecutorHandle("scripted:1", engine, lambda info: config, step_timeout_s=1.0)
    handle.info, handle.state = INFO, ExecutorState.READY
    handle.scheduler = Scheduler(config, tracer=engine.tracer)
    engine.executors[handle.address] = handle
    assert engine.on_executor_described(handle, INFO)
    engine.on_executor_ready(handle, INFO)
    return System(engine, handle, handle.scheduler, ScriptedExecutor()), exporter


def _request(request_id: str, **stopping: object) -> GenerationRequest:
    return GenerationRequest(request_id, prompt=PromptInput(token_ids=REPEATING_PROMPT), stopping=stopping)


def _held(system: System, request_id: str) -> tuple[int, int, bool]:
    """(traced sequences, sequences with a drafting record, whether the logs still map the request to a trace)."""
    assert system.engine.tracer is not None and system.scheduler.drafter is not None
    return system.engine.tracer.num_traces, len(system.scheduler.drafter.seq_ids), request_id in tracing.trace_ids


async def _started(system: System, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
    """The request's stream after a few steps (prefill, then decode steps that draft) and its first output."""
    stream = system.engine.generate(request)
    first = asyncio.create_task(anext(stream))
    await asyncio.sleep(0)  # admitted: it waits for its first output
    for _ in range(6):
        system.step()
    assert (await asyncio.wait_for(first, timeout=5)).token_ids
    return stream


async def test_requests_that_finish_or_are_cancelled_leave_no_per_sequence_state():
    system, exporter = _traced_system()
    # Cancelled midway: the stream is closed while the sequence decodes and drafts.
    stream = await _started(system, _request("cancelled", max_tokens=len(SCRIPT)))
    assert _held(system, "cancelled") == (1, 1, True)
    await stream.aclose()
    assert _held(system, "cancelled") == (0, 0, False)
    # To its length, and ended early by a stop string (the engine finishes it in the core).
    *_, last = await _generate(system, _request("length", max_tokens=10))
    assert last.finish_reason is FinishReason.LENGTH and _held(system, "length") == (0, 0, False)
    *_, last = await _generate(system, _request("stopped", stop=["quick"], max_tokens=len(SCRIPT)))
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, "quick")
    assert _held(system, "stopped") == (0, 0, False)
    spans = exporter.get_finished_spans()
    requests = sorted(s.attributes["pagoda.request_id"] for s in spans if s.name == "pagoda.request")
    assert requests == ["cancelled", "length", "stopped"]


async def test_a_lost_executor_takes_the_drafting_records_and_the_trace_follows_the_request():
    system, _ = _traced_system()
    stream = await _started(system, _request("moved", max_tokens=len(SCRIPT)))
    assert _held(system, "moved") == (1, 1, True)
    system.engine.on_executor_lost(system.handle, system.scheduler.take_all())
    # Placed again (here on the same core, whose drafter starts afresh); its trace stays until the request ends.
    assert _held(system, "moved") == (1, 0, True)
    await stream.aclose()
    assert _held(system, "moved") == (0, 0, False)
