"""The executor's spans (docs/tracing.md): one per traced sequence it holds, one per step that has one.

A sequence is traced when its NewSequence carries a `traceparent` (the request
span's context). Its `executor.sequence` span is a child of that request span,
from the plan that sent it to the plan that drops it (or the end of the
stream). A step that holds traced sequences gets one `executor.step` span with
a link to each of their request spans: never a span per request per step.
The servicer holds no StepTracer when tracing is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda import tracing
from pagoda.step import NewSequence, StepPlan, StepResult

if TYPE_CHECKING:
    from opentelemetry.trace import Link, Span, Tracer


class _Traced:
    """A traced sequence the executor holds: its span and the link its steps carry."""

    __slots__ = ("request_id", "span", "link")

    def __init__(self, request_id: str, span: Span, link: Link) -> None:
        self.request_id = request_id
        self.span = span
        self.link = link


class StepTracer:
    """Spans of the traced sequences and of the steps they take part in."""

    def __init__(self, tracer: Tracer, incarnation_id: str) -> None:
        self._tracer = tracer
        self._incarnation_id = incarnation_id
        # seq_id -> the traced sequences held.
        self._traced: dict[int, _Traced] = {}

    def on_plan(self, plan: StepPlan, start_ns: int) -> None:
        """A plan arrived at `start_ns` (wall-clock ns): its drops end spans, its new traced sequences start some."""
        for seq_id in plan.dropped_seq_ids:
            self._drop(seq_id, start_ns, "dropped")
        for new in plan.new_seqs:
            if new.traceparent:
                self._add(new, start_ns)

    def on_step(self, plan: StepPlan, result: StepResult, start_ns: int, end_ns: int) -> None:
        """The plan's step ran until `end_ns`: a span linked to its traced sequences, if it has any."""
        if not self._traced:
            return
        links = [t.link for t in map(self._traced.get, _seq_ids(plan)) if t is not None]
        if links:
            self._step_span(plan, result, links, start_ns, end_ns)

    def end_all(self, reason: str) -> None:
        """The stream ended: every sequence span ends (the executor forgets its sequences)."""
        for seq_id in list(self._traced):
            self._drop(seq_id, None, reason)

    def _add(self, new: NewSequence, start_ns: int) -> None:
        from opentelemetry.trace import Link

        self._drop(new.seq_id, start_ns, "readmitted")
        parent = tracing.context_of(new.traceparent)
        attributes: dict[str, Any] = {
            "pagoda.request_id": new.request_id,
            "pagoda.seq_id": new.seq_id,
            "pagoda.num_tokens": len(new.token_ids),
            "pagoda.num_computed_tokens": new.num_computed_tokens,
            "pagoda.incarnation_id": self._incarnation_id,
        }
        span = self._tracer.start_span("executor.sequence", parent, attributes=attributes, start_time=start_ns)
        # No attributes on the link: the SDK copies a link's attributes into every span that carries it.
        link = Link(tracing.span_context_of(new.traceparent))
        self._traced[new.seq_id] = _Traced(new.request_id, span, link)
        tracing.trace_ids[new.request_id] = tracing.trace_id_of(new.traceparent)

    def _drop(self, seq_id: int, end_ns: int | None, reason: str) -> None:
        traced = self._traced.pop(seq_id, None)
        if traced is not None:
            tracing.trace_ids.pop(traced.request_id, None)
            traced.span.set_attribute("pagoda.end_reason", reason)
            traced.span.end(end_ns)

    def _step_span(self, plan: StepPlan, result: StepResult, links: list[Link], start_ns: int, end_ns: int) -> None:
        from opentelemetry.context import Context

        timings = result.timings
        attributes: dict[str, Any] = {
            "pagoda.step_id": plan.step_id,
            "pagoda.batch_size": len(plan.new_seqs) + len(plan.scheduled_seqs),
            "pagoda.num_new_seqs": len(plan.new_seqs),
            "pagoda.num_tokens": plan.num_scheduled_tokens,
            "pagoda.num_traced_seqs": len(links),
            "pagoda.prepare_ns": timings.prepare_ns,
            "pagoda.forward_ns": timings.forward_ns,
            "pagoda.sample_ns": timings.sample_ns,
            "pagoda.draft_ns": timings.draft_ns,
            "pagoda.incarnation_id": self._incarnation_id,
        }
        # A root span (an empty context): a step belongs to no one request.
        span = self._tracer.start_span(
            "executor.step", Context(), attributes=attributes, links=links, start_time=start_ns
        )
        span.end(end_ns)


def _seq_ids(plan: StepPlan) -> list[int]:
    return [s.seq_id for s in plan.new_seqs] + [s.seq_id for s in plan.scheduled_seqs]
