"""The plain types of a scheduler core: what one step result did to a sequence, what the core counts, and what
it tells the request tracer. Its configuration is in scheduler_svc/core/config.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pagoda.step import LogprobEntry
from scheduler_svc.core.sequence import SchedulerSequence


class SeqUpdate(NamedTuple):
    """What one step result did to one sequence (a named tuple: cheap to make per token)."""

    seq: SchedulerSequence
    # Tokens accepted this step (the stop token included); empty on error.
    new_token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...]
    # The sequence finished in this update (see seq.finish_reason).
    finished: bool


@dataclass(slots=True)
class SchedulerCounters:
    """What one scheduler core counted since it started (the metrics export what grew since the last step)."""

    num_preemptions: int = 0
    # Sequences recomputed on LongRoPE's long factors after growing past the switch length.
    num_rope_restarts: int = 0
    # Prompt (or resumed) tokens loaded from the offload tier instead of computed.
    num_offload_hit_tokens: int = 0
    # Preempted sequences resumed by loading their blocks from the offload tier.
    num_swaps: int = 0


class SequenceTracer(Protocol):
    """What a scheduler core tells the request tracer (docs/tracing.md) as it moves a sequence.

    The tracer keeps the spans of traced sequences by seq_id and ignores the others
    (scheduler_svc.obs.request_trace.RequestTracer); None in the core: tracing is off.
    """

    def traceparent(self, seq_id: int) -> str:
        """What the sequence's NewSequence.traceparent carries ("" when it is not traced)."""
        ...

    def on_preempted(self, seq: SchedulerSequence) -> None:
        """The core freed the sequence's blocks (before it is requeued): it will be recomputed."""
        ...

    def on_rope_switch(self, seq: SchedulerSequence) -> None:
        """The sequence outgrew LongRoPE's short factors (before it is requeued): recomputed on the long ones."""
        ...
