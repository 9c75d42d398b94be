"""The executor's spans (SDK in memory): a span per traced sequence held, a linked span per step that has one."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from executor_svc.serving.step_tracing import StepTracer
from pagoda import tracing
from pagoda.params import SamplingParams
from pagoda.step import NewSequence, ScheduledSequence, StepPlan, StepResult, StepTimings

TRACED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _new(seq_id: int, traceparent: str = "") -> NewSequence:
    return NewSequence(seq_id, f"r{seq_id}", (1, 2, 3), 3, SamplingParams(), (0,), 0, 3, traceparent=traceparent)


def _run(tracer: StepTracer, plan: StepPlan, t: int) -> None:
    tracer.on_plan(plan, t)
    tracer.on_step(plan, StepResult(plan.step_id, timings=StepTimings(forward_ns=5, sample_ns=1)), t, t + 10)


def test_steps_link_to_traced_sequences_only_and_drops_end_their_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = StepTracer(provider.get_tracer("test"), "inc-1")
    _run(tracer, StepPlan(0, new_seqs=(_new(1), _new(2, TRACED))), 100)
    assert tracing.trace_ids == {"r2": TRACED.split("-")[1]}
    _run(tracer, StepPlan(1, scheduled_seqs=(ScheduledSequence(1, 1), ScheduledSequence(2, 1))), 200)
    _run(tracer, StepPlan(2, scheduled_seqs=(ScheduledSequence(1, 1),), dropped_seq_ids=(2,)), 300)
    spans = exporter.get_finished_spans()
    steps = [s for s in spans if s.name == "executor.step"]
    # The third step holds no traced sequence: no span.
    assert [s.attributes["pagoda.step_id"] for s in steps] == [0, 1]
    assert [s.attributes["pagoda.batch_size"] for s in steps] == [2, 2]
    assert all(s.parent is None and len(s.links) == 1 for s in steps)
    assert f"{steps[0].links[0].context.span_id:016x}" == TRACED.split("-")[2]
    (sequence,) = [s for s in spans if s.name == "executor.sequence"]
    assert f"{sequence.parent.span_id:016x}" == TRACED.split("-")[2]
    assert (sequence.start_time, sequence.end_time, sequence.attributes["pagoda.end_reason"]) == (100, 300, "dropped")
    assert tracing.trace_ids == {}
