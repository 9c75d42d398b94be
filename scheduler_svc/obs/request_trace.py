"""The spans of traced requests in the scheduler (docs/tracing.md).

`RequestTracer` exists only when tracing is on (the engine holds None
otherwise); it starts a `RequestTrace` per sampled request, keeps it by
seq_id until the request ends, and feeds it what the engine sees: the plans
that ran, executor losses, the end. The scheduler cores tell it of
preemptions and LongRoPE restarts, and ask it for the traceparent of an
admission (it is their `SequenceTracer`, scheduler_svc.core.scheduler_types).
Nothing here runs per token: a traced sequence costs a few integer
operations per step it is in, an untraced one a dict lookup.

OpenTelemetry is imported by this module only under TYPE_CHECKING; the spans
come from the tracer `pagoda.tracing.setup_tracing` made.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pagoda import tracing
from pagoda.step import FinishReason, StepPlan

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.util.types import Attributes

    from scheduler_svc.core.sequence import SchedulerSequence
    from scheduler_svc.request import GenerationRequest

_FAILED = (FinishReason.ERROR, FinishReason.ABORT)


class RequestTrace:
    """One request's spans: the request, its waits in a queue, its prefills (chunked), its decode, its finish."""

    def __init__(self, tracer: Tracer, request: GenerationRequest, seq: SchedulerSequence) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._tracer = tracer
        attributes: Attributes = {
            "pagoda.request_id": seq.request_id,
            "pagoda.seq_id": seq.seq_id,
            "pagoda.num_prompt_tokens": seq.num_prompt_tokens,
            "pagoda.max_tokens": seq.stopping.max_tokens,
            "pagoda.priority": seq.priority,
            **({"pagoda.lora": seq.lora_name} if seq.lora_name else {}),
        }
        parent = tracing.context_of(request.traceparent)
        self.span: Span = tracer.start_span("pagoda.request", parent, SpanKind.SERVER, attributes)
        self._context = set_span_in_context(self.span)
        # What NewSequence.traceparent carries: the executor's spans hang under (and link to) the request span.
        self.traceparent = tracing.traceparent_of(self.span)
        self.request_id = seq.request_id
        self._queue: Span | None = None
        self._prefill: Span | None = None
        self._decode: Span | None = None
        # Tokens the current admission's prefill must reach, and how far its planned chunks got.
        self._prefill_target = 0
        self._num_planned = 0
        self._admitted = False

    @property
    def sampled(self) -> bool:
        """Whether the sampler kept this request (an unsampled one is not traced downstream)."""
        return self.span.get_span_context().trace_flags.sampled

    def _child(self, name: str, attributes: Attributes, start_ns: int | None = None) -> Span:
        return self._tracer.start_span(name, self._context, attributes=attributes, start_time=start_ns)

    def _event_span(self) -> Span:
        """Events go on the decode span once it runs, else on the request span."""
        return self._decode if self._decode is not None else self.span

    def on_queued(self, reason: str) -> None:
        """The sequence waits for a step to admit it (`new`, `preempted`, `executor_lost`)."""
        if self._queue is None:
            self._queue = self._child("queue", {"pagoda.queue_reason": reason})
        self._admitted = False

    def on_resumed(self, num_delivered: int) -> None:
        """A client resumed the request after `num_delivered` tokens (docs/durability.md)."""
        self.span.add_event("resumed", {"pagoda.num_delivered_tokens": num_delivered})

    def on_admitted(self, executor: str, num_tokens: int, num_hit_tokens: int, start_ns: int) -> None:
        """A step admitted the sequence (its NewSequence): the wait ends, a prefill starts."""
        if self._queue is not None:
            self._queue.set_attribute("pagoda.executor", executor)
            self._queue.end(start_ns)
            self._queue = None
        recompute = self._decode is not None
        if num_hit_tokens:
            self._event_span().add_event("prefix_cache_hit", {"pagoda.num_tokens": num_hit_tokens}, start_ns)
        self._end_prefill(None)
        attributes: Attributes = {
            "pagoda.executor": executor,
            "pagoda.num_tokens": num_tokens,
            "pagoda.prefix_cache_hit_tokens": num_hit_tokens,
            "pagoda.recompute": recompute,
        }
        self._prefill = self._child("prefill", attributes, start_ns)
        self._prefill_target, self._num_planned, self._admitted = num_tokens, num_hit_tokens, True

    def on_ran(self, step_id: int, num_tokens: int, start_ns: int, end_ns: int) -> None:
        """A step computed `num_tokens` of this sequence: a prefill chunk, or the first token's step."""
        if not self._admitted or self._prefill is None:
            return
        chunk = self._tracer.start_span(
            "prefill.chunk",
            self._prefill_context,
            attributes={
                "pagoda.step_id": step_id,
                "pagoda.num_tokens": num_tokens,
                "pagoda.num_computed_tokens": self._num_planned,
            },
            start_time=start_ns,
        )
        chunk.end(end_ns)
        self._num_planned += num_tokens
        if self._num_planned >= self._prefill_target:
            self._end_prefill(end_ns)
            if self._decode is None:
                self._decode = self._child("decode", {}, end_ns)

    @property
    def _prefill_context(self) -> Any:
        from opentelemetry.trace import set_span_in_context

        return set_span_in_context(self._prefill) if self._prefill is not None else self._context

    def _end_prefill(self, end_ns: int | None) -> None:
        if self._prefill is not None:
            if end_ns is None:  # interrupted (preempted, executor lost): it ends unfinished
                self._prefill.set_attribute("pagoda.interrupted", True)
            self._prefill.end(end_ns)
            self._prefill = None

    def on_preempted(self, num_computed_tokens: int) -> None:
        """The scheduler core freed the sequence's blocks; it will be recomputed."""
        self._event_span().add_event("preempted", {"pagoda.num_computed_tokens": num_computed_tokens})
        self._end_prefill(None)
        self.on_queued("preempted")

    def on_rope_switch(self, num_computed_tokens: int) -> None:
        """The sequence outgrew LongRoPE's short factors: recomputed on the long ones (docs/decisions.md)."""
        self._event_span().add_event("rope_switch", {"pagoda.num_computed_tokens": num_computed_tokens})
        self._end_prefill(None)
        self.on_queued("rope_switch")

    def on_executor_lost(self, executor: str, num_tokens: int) -> None:
        """The sequence's executor is gone: it is recomputed (`num_tokens`) where it is placed next."""
        attributes: Attributes = {"pagoda.executor": executor, "pagoda.num_tokens": num_tokens}
        self._event_span().add_event("executor_lost", attributes)
        self._end_prefill(None)
        self.on_queued("executor_lost")

    def end(self, seq: SchedulerSequence, reason: FinishReason) -> None:
        """The request is over: a `finish` span with its reason; every open span ends."""
        from opentelemetry.trace import StatusCode

        if self._decode is not None:
            self._decode.set_attribute("pagoda.num_output_tokens", len(seq.output_token_ids))
        for span in (self._queue, self._prefill, self._decode):
            if span is not None:
                span.end()
        finish = self._child("finish", {"pagoda.finish_reason": reason.value})
        if seq.stop_reason is not None:
            finish.set_attribute("pagoda.stop_reason", seq.stop_reason)
        self.span.set_attributes(
            {
                "pagoda.finish_reason": reason.value,
                "pagoda.num_completion_tokens": len(seq.output_token_ids),
                "pagoda.num_cached_tokens": seq.num_cached_tokens,
                "pagoda.num_preemptions": seq.num_preemptions,
            }
        )
        if reason in _FAILED:
            for span in (finish, self.span):
                span.set_status(StatusCode.ERROR, seq.error_message or reason.value)
        finish.end()
        self.span.end()


class RequestTracer:
    """Starts the traces of sampled requests and routes what the engine sees to them."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        # seq_id -> trace of the traced sequences in flight.
        self._traces: dict[int, RequestTrace] = {}

    @property
    def num_traces(self) -> int:
        """Traced sequences in flight (each until `end`)."""
        return len(self._traces)

    def start(self, request: GenerationRequest, seq: SchedulerSequence) -> None:
        """Trace a new request (kept until `end` when the sampler keeps it)."""
        trace = RequestTrace(self._tracer, request, seq)
        if not trace.sampled:
            trace.span.end()
            return
        self._traces[seq.seq_id] = trace
        tracing.trace_ids[seq.request_id] = tracing.trace_id_of(trace.traceparent)
        if request.resume is not None:
            trace.on_resumed(len(request.resume.delivered_token_ids))
        trace.on_queued("new")

    def on_step(self, executor: str, plan: StepPlan, duration_s: float) -> None:
        """A step's result arrived `duration_s` after its plan was sent: admissions and chunks of traced sequences."""
        traces = self._traces
        if not traces:
            return
        end_ns = time.time_ns()
        start_ns = end_ns - int(duration_s * 1e9)
        for new in plan.new_seqs:
            trace = traces.get(new.seq_id)
            if trace is not None:
                num_tokens = len(new.token_ids)
                trace.on_admitted(executor, num_tokens, new.num_computed_tokens, start_ns)
                trace.on_ran(plan.step_id, new.num_scheduled_tokens, start_ns, end_ns)
        for scheduled in plan.scheduled_seqs:
            trace = traces.get(scheduled.seq_id)
            if trace is not None:
                trace.on_ran(plan.step_id, scheduled.num_scheduled_tokens, start_ns, end_ns)

    def traceparent(self, seq_id: int) -> str:
        """What an admission of the sequence tells the executor ("" when it is not traced)."""
        trace = self._traces.get(seq_id)
        return trace.traceparent if trace is not None else ""

    def on_preempted(self, seq: SchedulerSequence) -> None:
        """A scheduler core preempted the sequence."""
        trace = self._traces.get(seq.seq_id)
        if trace is not None:
            trace.on_preempted(seq.num_computed_tokens)

    def on_rope_switch(self, seq: SchedulerSequence) -> None:
        """A scheduler core restarts the sequence on LongRoPE's long factors."""
        trace = self._traces.get(seq.seq_id)
        if trace is not None:
            trace.on_rope_switch(seq.num_computed_tokens)

    def on_executor_lost(self, executor: str, seqs: list[SchedulerSequence]) -> None:
        """Every traced sequence of a lost executor gets the event (and waits again)."""
        for seq in seqs:
            trace = self._traces.get(seq.seq_id)
            if trace is not None:
                trace.on_executor_lost(executor, seq.num_tokens)

    def end(self, seq: SchedulerSequence, reason: FinishReason) -> None:
        """The request left the engine."""
        trace = self._traces.pop(seq.seq_id, None)
        if trace is not None:
            tracing.trace_ids.pop(seq.request_id, None)
            trace.end(seq, reason)
