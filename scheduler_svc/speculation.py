"""When to speculate, per sequence and per step, and what came of it.

The scheduler proposes n-gram drafts (scheduler_svc.ngram) for decoding
sequences; the executor verifies them as extra query tokens of the same
forward pass (docs/speculative-decoding.md). Speculation pays only where a
step costs about the same for 1 token as for 1 + K, and where drafts are
accepted:

- Globally: no drafts while more than ``max_batch`` sequences run. A decode
  step is bound by streaming the weights up to about 8 sequences and grows
  with the tokens beyond that (SmolLM2 bf16 on CPU, bench/data/
  step_cost_smollm2_bf16.json: batch 8 costs 1.18x batch 1, batch 32 1.9x);
  drafts would then cost what they save.
- Per sequence: an exponentially weighted mean of the tokens accepted per
  attempt (a step where it could draft; finding no n-gram counts as 0). Below
  ``MIN_ACCEPTED_PER_ATTEMPT`` the sequence stops drafting for a cooldown of
  generated tokens that doubles each time, then tries again.

Pure Python.
"""

from __future__ import annotations

from pagoda.step import ScheduledSequence
from scheduler_svc.kv_cache_manager import KVCacheManager, cdiv
from scheduler_svc.ngram import NgramProposer
from scheduler_svc.scheduler_types import SchedulerConfig
from scheduler_svc.sequence import SchedulerSequence
from scheduler_svc.step_builder import StepBuilder, StepEntry

# Weight of the newest attempt in the mean of accepted tokens per attempt.
EWMA_WEIGHT = 0.25
# Below this many accepted tokens per attempt, drafting loses: the step is no longer overlapped with the
# scheduler's work (drafts need the known tokens), and the draft rows cost compute.
MIN_ACCEPTED_PER_ATTEMPT = 0.3
# Generated tokens a sequence waits before drafting again, first and at most.
FIRST_COOLDOWN_TOKENS = 16
MAX_COOLDOWN_TOKENS = 512
SPECULATIVE_METHODS = ("off", "ngram", "draft")


class SeqSpeculation:
    """One sequence's n-gram index and its record of accepted drafts."""

    __slots__ = ("proposer", "mean_accepted", "resume_at", "cooldown")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.proposer = NgramProposer(min_n, max_n)
        # Optimistic start: a few fruitless attempts are needed before it stops.
        self.mean_accepted = 1.0
        # Drafting resumes once the sequence has this many output tokens.
        self.resume_at = 0
        self.cooldown = FIRST_COOLDOWN_TOKENS

    def active(self, num_output_tokens: int) -> bool:
        """Whether the sequence drafts now (not cooling down)."""
        return num_output_tokens >= self.resume_at

    def record(self, num_accepted: int, num_output_tokens: int) -> None:
        """One attempt's accepted drafts (0 when no n-gram matched); may start a cooldown."""
        self.mean_accepted += EWMA_WEIGHT * (num_accepted - self.mean_accepted)
        if self.mean_accepted >= MIN_ACCEPTED_PER_ATTEMPT:
            return
        self.resume_at = num_output_tokens + self.cooldown
        self.cooldown = min(2 * self.cooldown, MAX_COOLDOWN_TOKENS)
        # After the cooldown, one fruitless attempt stops it again; one accepted token keeps it going.
        self.mean_accepted = MIN_ACCEPTED_PER_ATTEMPT


class SpeculationStats:
    """Counters of one scheduler core (exported as metrics)."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")

    def __init__(self) -> None:
        # Sequence-steps that verified drafts, the tokens drafted, and those accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted


class Drafter:
    """The speculation of one scheduler core: which sequences draft, their drafts in a plan, the rollback."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.stats = SpeculationStats()

    def allows(self, num_running: int) -> bool:
        """The global rule: drafts only while the step is bound by the weights, not by the tokens."""
        return num_running <= self.config.speculative_max_batch

    def wants(self, seq: SchedulerSequence) -> bool:
        """Whether seq would draft in the next step (it may still find no n-gram)."""
        spec = seq.speculation
        return seq.structured is None and (spec is None or spec.active(len(seq.output_token_ids)))

    def schedule(self, seq: SchedulerSequence, step: StepBuilder) -> bool:
        """Plans seq's next token with drafts after it, if it has drafts and their blocks are free.

        Drafts never preempt: without free blocks the sequence decodes one token.
        """
        config = self.config
        max_tokens = min(step.budget - step.num_decodes_left - 1, config.max_model_len - len(seq.token_ids) - 1)
        drafts = self.propose(seq, max_tokens)
        if not drafts:
            return False
        num_tokens = 1 + len(drafts)
        new_block_ids: list[int] | None = []
        if seq.num_computed_tokens + num_tokens > len(seq.block_ids) * config.block_size:
            new_block_ids = self.kv.allocate_slots(seq, num_tokens)
        if new_block_ids is None:
            return False
        step.scheduled_seqs.append(ScheduledSequence(seq.seq_id, 1, tuple(new_block_ids), drafts))
        step.commit(seq, 1, len(drafts))
        return True

    def propose(self, seq: SchedulerSequence, max_tokens: int) -> tuple[int, ...]:
        """Drafts for seq's next tokens, at most max_tokens of them.

        Only for a sequence whose tokens are all known (no pending one), that is
        not constrained (its drafts would need the constraint's masks) and not
        cooling down. Finding nothing counts as a fruitless attempt.
        """
        if seq.num_pending_tokens or not self.wants(seq):
            return ()
        # Every accepted draft plus the executor's own token must fit max_tokens.
        max_outputs = seq.stopping.max_tokens - len(seq.output_token_ids) - 1
        max_tokens = min(max_tokens, self.config.num_speculative_tokens, max_outputs)
        if max_tokens <= 0:
            return ()
        if seq.speculation is None:
            seq.speculation = SeqSpeculation()
        drafts = seq.speculation.proposer.propose(seq.token_ids, max_tokens)
        if not drafts:
            seq.speculation.record(0, len(seq.output_token_ids))
        return drafts

    def on_verified(self, seq: SchedulerSequence, entry: StepEntry, num_accepted: int, current: bool) -> None:
        """Rolls back the KV of rejected drafts: fewer computed tokens, blocks past the computed ones freed.

        The executor cuts its block table by the same rule, so both keep the same blocks;
        the freed ones held rejected KV only and are never offered to the prefix cache.
        """
        seq.drafts_in_flight = False
        num_rejected = entry.num_drafts - num_accepted
        entry.num_computed_after -= num_rejected
        if current:
            seq.num_computed_tokens -= num_rejected
            self.kv.truncate(seq, cdiv(seq.num_computed_tokens, self.config.block_size))
        self.stats.record(entry.num_drafts, num_accepted)
        if seq.speculation is not None:
            seq.speculation.record(num_accepted, len(seq.output_token_ids))
