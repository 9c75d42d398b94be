"""The plan one schedule() call is building, and what is kept of it until its result."""

from __future__ import annotations

from pagoda.step import NewSequence, ScheduledSequence
from scheduler_svc.core.config import DraftSource
from scheduler_svc.core.sequence import SchedulerSequence


class StepEntry:
    """One sequence in a planned step, kept until the step's result arrives."""

    __slots__ = ("seq", "num_admissions", "num_computed_after", "samples", "num_drafts", "draft_source")

    def __init__(
        self, seq: SchedulerSequence, samples: bool, num_drafts: int = 0, draft_source: DraftSource = DraftSource.NGRAM
    ) -> None:
        self.seq = seq
        # Tells apart a later admission of the same sequence (after preemption).
        self.num_admissions = seq.num_admissions
        # KV computed once this step has run: what its result confirms.
        self.num_computed_after = seq.num_computed_tokens
        # The step samples a token for this sequence (its chunk reaches its length).
        self.samples = samples
        # Draft tokens it verifies after that token (their KV counts in num_computed_after until the result).
        self.num_drafts = num_drafts
        self.draft_source = draft_source


class StepBuilder:
    """Budget left and sequences planned so far in one step."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.new_seqs: list[NewSequence] = []
        self.scheduled_seqs: list[ScheduledSequence] = []
        self.entries: dict[int, StepEntry] = {}
        # Decode-ready running sequences not visited yet: prefill chunks leave
        # them one token each so a long prompt never stalls decoding.
        self.num_decodes_left = 0
        self.num_preempted = 0
        # Decoding sequences may draft in this step (the global rule allows it).
        self.speculate = False
        # Sequences that draft in this step, and those of them that draft with the executor's draft model.
        self.num_drafts = 0
        # Blocks new sequences of this step load from the offload tier.
        self.num_loads = 0
        self.num_model_drafts = 0
        # A sequence drafting with the draft model catches its KV up on earlier tokens first: the step's
        # time does not measure what drafting costs.
        self.model_catch_up = False

    def commit(
        self, seq: SchedulerSequence, num_tokens: int, num_drafts: int = 0, source: DraftSource = DraftSource.NGRAM
    ) -> None:
        """Advances a planned sequence; reaching its length samples a pending token.

        num_computed_tokens moves now, not when the result arrives: the next
        plan may be built before then, and must start where this one ends.
        Drafts count as computed until the result says how many were accepted.
        """
        seq.num_computed_tokens += num_tokens
        samples = seq.num_computed_tokens == len(seq.token_ids) + seq.num_pending_tokens
        if samples:
            seq.num_pending_tokens += 1
        if num_drafts:
            seq.num_computed_tokens += num_drafts
            seq.drafts_in_flight = True
            self.num_drafts += 1
            self.num_model_drafts += source is DraftSource.MODEL
        self.entries[seq.seq_id] = StepEntry(seq, samples, num_drafts, source)
        self.budget -= num_tokens + num_drafts
