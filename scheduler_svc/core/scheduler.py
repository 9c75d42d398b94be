"""The scheduler core of one executor: what each step computes, and what came of it.

Each step spends a token budget on running sequences first (one decode token
each, or the next chunk of their prompt) and then admits waiting ones, whose
prompts are chunked when longer than what is left. There are no prefill and
decode phases: every sequence's num_computed_tokens just catches up with its
length. When blocks run out, the lowest-priority, most recently admitted
running sequence is preempted and later recomputed (the prefix cache makes
that cheap).

LongRoPE models (Phi-3 128k) rotate a sequence within ``rope_switch_len``
tokens with the short factors and a longer one with the long factors, as
transformers does: the set is chosen at admission by the sequence's length,
and a sequence that grows past the switch is recomputed on the long factors.

Plans overlap with results: the engine sends plan N+1 before result N arrives.
schedule() therefore advances num_computed_tokens when it plans, and a sequence
whose chunk reaches its length gets a pending token that update() fills in.
The executor appends its own sampled tokens, so a sequence with a pending
token can be scheduled again for one token.

Pure Python: no torch, no numpy, no protos (pagoda.step's dataclasses are plain).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from pagoda.step import (
    FinishReason,
    LogprobEntry,
    ScheduledSequence,
    SeqError,
    StepPlan,
    StepResult,
)
from scheduler_svc.core.admission import Admission
from scheduler_svc.core.config import SchedulerConfig as SchedulerConfig
from scheduler_svc.core.inflight import InflightStep, InflightSteps
from scheduler_svc.core.roster import Roster
from scheduler_svc.core.scheduler_types import SchedulerCounters, SequenceTracer
from scheduler_svc.core.scheduler_types import SeqUpdate as SeqUpdate
from scheduler_svc.core.sequence import SchedulerSequence, SequenceStatus
from scheduler_svc.core.step_builder import StepBuilder, StepEntry
from scheduler_svc.kv.kv_cache_manager import BlockHasher, KVCacheManager, cdiv, hash_block_tokens
from scheduler_svc.kv.tier_index import TierIndex
from scheduler_svc.spec.speculation import Drafter

# A sequence is planned at most this many tokens ahead of the results (the
# engine keeps at most two plans in flight, so this only guards misuse).
MAX_PENDING_TOKENS = 2


class Scheduler:
    """Plans the steps of one executor and applies their results.

    Its parts, each owning one thing: ``roster`` (where each sequence is), ``kv`` (block accounting and the
    prefix cache), ``tier`` (the executor's offload tier as known here), ``drafter`` (speculation),
    ``inflight`` (plans whose results have not arrived) and ``counters``.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
        block_hasher: BlockHasher = hash_block_tokens,
        tier_hashes: Iterable[int] = (),
        tracer: SequenceTracer | None = None,
    ):
        """``tier_hashes``: what the executor's offload tier holds (its Describe), with ``config.kv_offload``;
        ``tracer``: told of preemptions and restarts (None: tracing off)."""
        self.config = config
        self._clock = clock
        self._tracer = tracer
        self.tier = TierIndex(config.block_size, tier_hashes) if config.kv_offload else None
        self.kv = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, block_hasher, self.tier
        )
        self.drafter = Drafter(config, self.kv) if config.speculative != "off" else None
        self.roster = Roster(config.max_priority_wait_s)
        self.inflight = InflightSteps()
        self.counters = SchedulerCounters()
        self._admission = Admission(config, self.roster, self.kv, self.tier, self.counters, tracer)
        self._next_step_id = 0

    # -- state ----------------------------------------------------------------

    @property
    def running(self) -> list[SchedulerSequence]:
        """Running sequences in rank order (do not modify)."""
        return self.roster.running

    @property
    def num_running(self) -> int:
        return len(self.roster.running)

    @property
    def num_waiting(self) -> int:
        return len(self.roster.waiting)

    @property
    def may_plan_ahead(self) -> bool:
        """Whether the next plan may be built before the last one's result arrives.

        Not while a step verifying drafts is in flight (how many tokens it adds is
        unknown), nor while a sequence would draft (drafts follow the known tokens).
        """
        if self.inflight.verifying_drafts:
            return False
        drafter = self.drafter
        if drafter is None or not drafter.allows(len(self.running)):
            return True
        return not any(drafter.wants(seq) for seq in self.running)

    def has_unfinished(self) -> bool:
        return len(self.roster) > 0

    def get(self, seq_id: int) -> SchedulerSequence | None:
        """The unfinished sequence with this id, or None."""
        return self.roster.get(seq_id)

    def can_fit(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a request could ever run here: within max_model_len and the whole pool."""
        num_tokens = num_prompt_tokens + max_tokens
        return (
            num_prompt_tokens > 0
            and max_tokens > 0
            and num_tokens <= self.config.max_model_len
            and cdiv(num_tokens, self.config.block_size) <= self.config.num_blocks
        )

    def peek_prefix_hit_tokens(self, token_ids: Sequence[int], cache_salt: str = "", lora: str = "") -> int:
        """Prompt tokens the prefix cache would serve now (for the router); no side effects. ``lora``: the
        fingerprint of the sequence's LoRA adapter."""
        return self.kv.peek_prefix_hit_tokens(token_ids, cache_salt, self.config.long_rope(len(token_ids)), lora)

    # -- requests in and out ----------------------------------------------------

    def add(self, seq: SchedulerSequence) -> None:
        """Queues a sequence: new, or taken from another scheduler (then at its priority's head).

        Raises:
            ValueError: the id is in use, or the request can never fit (see can_fit).
        """
        if self.roster.get(seq.seq_id) is not None:
            raise ValueError(f"seq_id {seq.seq_id} is already scheduled")
        if not self.can_fit(seq.num_prompt_tokens, seq.stopping.max_tokens):
            raise ValueError(
                f"{seq.num_prompt_tokens} prompt + {seq.stopping.max_tokens} max tokens cannot fit "
                f"(max_model_len {self.config.max_model_len}, "
                f"{self.config.num_blocks} blocks of {self.config.block_size})"
            )
        if seq.arrival_time_s is None:
            seq.arrival_time_s = self._clock()
        self.roster.add(seq, front=seq.num_admissions > 0)

    def finish(self, seq_id: int, reason: FinishReason, stop_reason: int | None = None) -> None:
        """Stops a sequence (stop string, error); its blocks are freed now. Unknown id: no-op."""
        seq = self.roster.get(seq_id)
        if seq is None:
            return
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._release(seq)

    def abort(self, seq_id: int) -> None:
        """A cancelled request: finished with ABORT. Unknown id: no-op."""
        self.finish(seq_id, FinishReason.ABORT)

    def take_all(self) -> list[SchedulerSequence]:
        """Removes every unfinished sequence and resets to empty (the executor is gone).

        The sequences keep their prompt and outputs so far; pending tokens are
        lost (the next executor samples them again) and nothing is computed.
        Their drafting records go with this core's drafter: where they are
        placed next, they start drafting afresh.
        """
        seqs = self.roster.take_all()
        for seq in seqs:
            seq.reset_for_recompute()
            seq.num_pending_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.kv.reset()
        self.inflight.clear()
        if self.drafter is not None:
            self.drafter.forget_all()
        return seqs

    # -- one step -----------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans one step. Send it when it has work or dropped ids; else it is not sent.

        An empty plan (no work, nothing dropped) does not use up its step_id.
        """
        if self.config.rope_switch_len:
            self._restart_past_rope_switch()
        step = StepBuilder(self.config.max_num_batched_tokens)
        step.speculate = self.drafter is not None and self.drafter.speculates(self.roster.running)
        self._schedule_running(step)
        if not step.num_preempted:
            self._admission.admit_waiting(step, self._clock())
        plan = StepPlan(
            step_id=self._next_step_id,
            new_seqs=tuple(step.new_seqs),
            scheduled_seqs=tuple(step.scheduled_seqs),
            dropped_seq_ids=self.roster.take_dropped(),
            saves=self.tier.take_saves() if self.tier is not None else (),
        )
        if plan.has_work:
            decode = self.drafter is not None and _is_decode(plan, self.config.speculative_max_batch)
            inflight = InflightStep(
                step.entries,
                drafts=step.num_model_drafts > 0 and not step.model_catch_up if step.num_drafts else None,
                decode_batch=len(plan.scheduled_seqs) if decode else 0,
                num_loads=step.num_loads,
            )
            self.inflight.add(plan.step_id, inflight)
        if plan.has_work or plan.dropped_seq_ids or plan.saves:
            self._next_step_id += 1
        return plan

    def update(self, result: StepResult) -> list[SeqUpdate]:
        """Applies one step's result: fills pending tokens, checks stops, caches full blocks.

        Outputs of sequences that finished meanwhile are ignored. A sequence the
        executor reports as failed finishes with ERROR (it dropped it already).
        """
        planned = self.inflight.pop(result.step_id)
        if self.drafter is not None:
            drafts, decode_batch = (planned.drafts, planned.decode_batch) if planned is not None else (None, 0)
            self.drafter.on_step(result.timings, decode_batch, drafts)
        if self.tier is not None:
            self.tier.apply(result)
            self.tier.cost.observe(planned.num_loads if planned is not None else 0, result)
        if planned is None:
            # A plan without work, or a result from before take_all().
            return []
        entries = planned.entries
        updates = self._apply_errors(result.errors, entries)
        outputs = {out.seq_id: out for out in result.outputs}
        for entry in entries.values():
            seq = entry.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            current = seq.status is SequenceStatus.RUNNING and seq.num_admissions == entry.num_admissions
            out = outputs.get(seq.seq_id)
            if out is not None and out.prompt_logprobs:
                seq.add_prompt_logprobs(out.prompt_logprobs_start, out.prompt_logprobs)
            if not entry.samples:
                if current:
                    self.kv.cache_full_blocks(seq, entry.num_computed_after)
                continue
            if out is None and not current:
                # An earlier admission's step that did not run (failed, or the executor had dropped it).
                seq.num_pending_tokens = max(0, seq.num_pending_tokens - 1)
                continue
            if out is None or not 1 <= len(out.token_ids) <= entry.num_drafts + 1:
                num = 0 if out is None else len(out.token_ids)
                message = f"executor returned {num} tokens for a step with {entry.num_drafts} drafts"
                updates.append(self._fail(seq.seq_id, message))
                continue
            if entry.num_drafts and self.drafter is not None:
                self.drafter.on_verified(seq, entry, len(out.token_ids) - 1, current)
            updates.append(self._accept_tokens(seq, out.token_ids, out.logprobs, entry, current))
        return updates

    # -- scheduling internals ---------------------------------------------------------

    def _schedule_running(self, step: StepBuilder) -> None:
        """Running sequences in rank order; a failed allocation preempts from the tail."""
        running, block_size = self.roster.running, self.config.block_size
        # Preemption pops from the tail of both lists, so indices stay aligned.
        wanted = [self._num_wanted(seq) for seq in running]
        step.num_decodes_left = wanted.count(1)
        i = 0
        while i < len(running) and step.budget > 0:
            seq, num_wanted = running[i], wanted[i]
            i += 1
            if num_wanted == 0:
                continue
            if num_wanted == 1:
                step.num_decodes_left -= 1
                num_tokens = 1
                if step.speculate and self.drafter is not None and self.drafter.schedule(seq, step):
                    continue
            else:
                num_tokens = min(num_wanted, step.budget - step.num_decodes_left)
                if num_tokens <= 0:
                    continue
            if seq.num_computed_tokens + num_tokens <= len(seq.block_ids) * block_size:
                new_block_ids: tuple[int, ...] = ()  # the common decode step: the last block has room
            else:
                allocated = self._allocate_or_preempt(seq, num_tokens, step, wanted)
                if allocated is None:
                    break
                new_block_ids = tuple(allocated)
            step.scheduled_seqs.append(ScheduledSequence(seq.seq_id, num_tokens, new_block_ids))
            step.commit(seq, num_tokens)

    def _num_wanted(self, seq: SchedulerSequence) -> int:
        """Tokens a running sequence has left to compute now (0: skip it this step).

        Skipped: two tokens ahead of the results already, or pending tokens
        that reach max_tokens or max_model_len (it stops when they arrive).
        """
        num_pending = seq.num_pending_tokens
        num_total = len(seq.token_ids) + num_pending
        if (
            seq.drafts_in_flight
            or num_pending >= MAX_PENDING_TOKENS
            or len(seq.output_token_ids) + num_pending >= seq.stopping.max_tokens
            or num_total >= self.config.max_model_len
        ):
            return 0
        return num_total - seq.num_computed_tokens

    def _allocate_or_preempt(
        self, seq: SchedulerSequence, num_tokens: int, step: StepBuilder, wanted: list[int]
    ) -> list[int] | None:
        """Blocks for seq, preempting from the tail of running until they fit.

        Returns None when seq itself was the one left to preempt. The tail is
        never a sequence already scheduled in this step (those come before seq).
        """
        while True:
            new_block_ids = self.kv.allocate_slots(seq, num_tokens)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.roster.running[-1]
            if victim is not seq and wanted.pop() == 1:
                step.num_decodes_left -= 1
            self._preempt_tail()
            step.num_preempted += 1
            if victim is seq:
                return None

    def _preempt_tail(self) -> None:
        """Frees the tail running sequence and puts it at the head of its priority; the executor drops it."""
        seq = self.roster.running[-1]
        if self._tracer is not None:
            self._tracer.on_preempted(seq)
        self.kv.free(seq)  # its full blocks stay cached
        self.roster.preempt_tail()
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1

    def _restart_past_rope_switch(self) -> None:
        """Sequences on the short LongRoPE factors whose next token is past the switch restart on the long ones.

        transformers computes each next token with the factors of the sequence's length, and recomputes its
        cache when the length crosses original_max_position_embeddings; so the sequence is recomputed here too
        (its short blocks stay cached for other short sequences). It resumes, on the long factors, once its
        pending token is known (_admit chooses the set).
        """
        switch = self.config.rope_switch_len
        crossing = [
            seq
            for seq in self.roster.running
            if seq.num_computed_tokens >= switch and not seq.long_rope and self._num_wanted(seq)
        ]
        for seq in crossing:
            if self._tracer is not None:
                self._tracer.on_rope_switch(seq)
            self.kv.free(seq)  # its short blocks stay cached
            self.roster.requeue(seq)
            self.counters.num_rope_restarts += 1

    # -- update internals ------------------------------------------------------------

    def _accept_tokens(
        self,
        seq: SchedulerSequence,
        token_ids: tuple[int, ...],
        logprobs: tuple[LogprobEntry, ...],
        entry: StepEntry,
        current: bool,
    ) -> SeqUpdate:
        """Fills a pending token (and accepted drafts before it), caches what they made full, checks stops.

        Tokens after one that stops the sequence are dropped, as if they had never been drafted.
        """
        config = self.config
        seq.num_pending_tokens -= 1
        finished = False
        num_taken = 0
        for token_id in token_ids:
            seq.append_token(token_id)
            num_taken += 1
            finished = seq.check_stop(token_id, config.eos_token_ids, config.max_model_len)
            if finished:
                break
        # Known and computed tokens reach the end of the next block to cache: it is full now.
        next_full_tokens = (seq.num_registered_blocks + 1) * config.block_size
        if current and min(entry.num_computed_after, len(seq.token_ids)) >= next_full_tokens:
            self.kv.cache_full_blocks(seq, entry.num_computed_after)
        if finished:
            self._release(seq)
        return SeqUpdate(seq, token_ids[:num_taken], logprobs[:num_taken], finished)

    def _apply_errors(self, errors: Sequence[SeqError], entries: dict[int, StepEntry]) -> list[SeqUpdate]:
        """Sequences the executor failed: tier misses are recomputed, other errors finish them.

        An error about an earlier admission of a sequence (preempted or recomputed since) is void.
        """
        updates = []
        for err in errors:
            seq = self.roster.get(err.seq_id)
            entry = entries.get(err.seq_id)
            if seq is None or (entry is not None and not self._is_current(seq, entry)):
                continue
            if err.missing_block_hashes and seq.status is SequenceStatus.RUNNING:
                self._recompute_after_miss(seq, err.missing_block_hashes)
            else:
                updates.append(self._fail(err.seq_id, err.message))
        return updates

    @staticmethod
    def _is_current(seq: SchedulerSequence, entry: StepEntry) -> bool:
        return seq.status is SequenceStatus.RUNNING and seq.num_admissions == entry.num_admissions

    def _recompute_after_miss(self, seq: SchedulerSequence, block_hashes: tuple[int, ...]) -> None:
        """The executor could not load blocks of seq and dropped it: forget them, admit it again at the head."""
        if self.tier is not None:
            self.tier.forget(block_hashes)
        self.kv.free(seq)
        seq.executor_holds = False  # it dropped the sequence already
        self.roster.requeue(seq)
        seq.recount_cached_tokens = seq.num_admissions == 1

    def _fail(self, seq_id: int, message: str) -> SeqUpdate:
        seq = self.roster.get(seq_id)
        assert seq is not None
        seq.error_message = message
        self.finish(seq_id, FinishReason.ERROR)
        return SeqUpdate(seq, (), (), True)

    def _release(self, seq: SchedulerSequence) -> None:
        """Finishes a sequence: frees its blocks (full ones stay cached), schedules its drop."""
        if seq.status is SequenceStatus.RUNNING:
            self.kv.free(seq)
        self.roster.finish(seq)
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)


def _is_decode(plan: StepPlan, max_batch: int) -> bool:
    """At most max_batch sequences, each computing one token (drafts aside): nothing admitted or prefilled."""
    return (
        not plan.new_seqs
        and len(plan.scheduled_seqs) <= max_batch
        and all(entry.num_scheduled_tokens == 1 for entry in plan.scheduled_seqs)
    )
