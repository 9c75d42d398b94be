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

import bisect
from collections.abc import Sequence

from pagoda.step import (
    BlockLoad,
    LogprobEntry,
    NewSequence,
    ScheduledSequence,
    SeqError,
    StepPlan,
    StepResult,
)
from scheduler_svc.core.config import SchedulerConfig as SchedulerConfig
from scheduler_svc.core.scheduler_state import SchedulerState
from scheduler_svc.core.scheduler_types import SeqUpdate as SeqUpdate
from scheduler_svc.core.sequence import SchedulerSequence, SequenceStatus
from scheduler_svc.core.step_builder import StepBuilder, StepEntry

# A sequence is planned at most this many tokens ahead of the results (the
# engine keeps at most two plans in flight, so this only guards misuse).
MAX_PENDING_TOKENS = 2


class Scheduler(SchedulerState):
    """Plans the steps of one executor and applies their results."""

    # -- one step -----------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans one step. Send it when it has work or dropped ids; else it is not sent.

        An empty plan (no work, nothing dropped) does not use up its step_id.
        """
        self._compact_running()
        if self.config.rope_switch_len:
            self._restart_past_rope_switch()
        step = StepBuilder(self.config.max_num_batched_tokens)
        step.speculate = self._drafter is not None and self._drafter.speculates(self._running)
        self._schedule_running(step)
        if not step.num_preempted:
            self._schedule_waiting(step, self._clock())
        plan = StepPlan(
            step_id=self._next_step_id,
            new_seqs=tuple(step.new_seqs),
            scheduled_seqs=tuple(step.scheduled_seqs),
            dropped_seq_ids=tuple(self._dropped),
            saves=self._tier.take_saves() if self._tier is not None else (),
        )
        self._dropped = []
        if plan.has_work:
            self._inflight[plan.step_id] = step.entries
            if step.num_drafts:
                self._draft_steps[plan.step_id] = step.num_model_drafts > 0 and not step.model_catch_up
            if self._drafter is not None and _is_decode(plan, self.config.speculative_max_batch):
                self._decode_batches[plan.step_id] = len(plan.scheduled_seqs)
            if step.num_loads:
                self._plan_loads[plan.step_id] = step.num_loads
        if plan.has_work or plan.dropped_seq_ids or plan.saves:
            self._next_step_id += 1
        return plan

    def update(self, result: StepResult) -> list[SeqUpdate]:
        """Applies one step's result: fills pending tokens, checks stops, caches full blocks.

        Outputs of sequences that finished meanwhile are ignored. A sequence the
        executor reports as failed finishes with ERROR (it dropped it already).
        """
        entries = self._inflight.pop(result.step_id, None)
        drafts = self._draft_steps.pop(result.step_id, None)
        decode_batch = self._decode_batches.pop(result.step_id, 0)
        if self._drafter is not None:
            self._drafter.on_step(result.timings, decode_batch, drafts)
        if self._tier is not None:
            self._tier.apply(result)
            self._tier.cost.observe(self._plan_loads.pop(result.step_id, 0), result)
        if entries is None:
            # A plan without work, or a result from before take_all().
            return []
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
                    self._kv.cache_full_blocks(seq, entry.num_computed_after)
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
            if entry.num_drafts and self._drafter is not None:
                self._drafter.on_verified(seq, entry, len(out.token_ids) - 1, current)
            updates.append(self._accept_tokens(seq, out.token_ids, out.logprobs, entry, current))
        return updates

    # -- scheduling internals ---------------------------------------------------------

    def _schedule_running(self, step: StepBuilder) -> None:
        """Running sequences in rank order; a failed allocation preempts from the tail."""
        running, block_size = self._running, self.config.block_size
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
                if step.speculate and self._drafter is not None and self._drafter.schedule(seq, step):
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
            new_block_ids = self._kv.allocate_slots(seq, num_tokens)
            if new_block_ids is not None:
                return new_block_ids
            victim = self._running[-1]
            if victim is not seq and wanted.pop() == 1:
                step.num_decodes_left -= 1
            self._preempt(victim)
            step.num_preempted += 1
            if victim is seq:
                return None

    def _preempt(self, seq: SchedulerSequence) -> None:
        """Frees the tail running sequence and puts it at the head of its priority."""
        assert self._running[-1] is seq
        if self._tracer is not None:
            self._tracer.on_preempted(seq)
        self._running.pop()
        self._requeue(seq)
        seq.num_preemptions += 1
        self._num_preemptions += 1

    def _requeue(self, seq: SchedulerSequence) -> None:
        """Frees a sequence taken out of running (its full blocks stay cached) and puts it at the head of its
        priority, to be recomputed; the executor drops it."""
        self._kv.free(seq)
        if seq.executor_holds:
            self._dropped.append(seq.seq_id)
        seq.reset_for_recompute()
        seq.status = SequenceStatus.WAITING
        self._waiting.push(seq, front=True)

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
            for seq in self._running
            if seq.num_computed_tokens >= switch and not seq.long_rope and self._num_wanted(seq)
        ]
        for seq in crossing:
            if self._tracer is not None:
                self._tracer.on_rope_switch(seq)
            self._requeue(seq)
            self.num_rope_restarts += 1
        if crossing:
            self._running = [seq for seq in self._running if seq.status is SequenceStatus.RUNNING]

    def _schedule_waiting(self, step: StepBuilder, now_s: float) -> None:
        """Admits waiting sequences in order while budget, seats and blocks last."""
        while step.budget > 0 and len(self._running) < self.config.max_num_seqs:
            head = self._waiting.peek(now_s)
            # A preempted sequence waits for its pending token before it resumes.
            if head is None or head[0].num_pending_tokens or not self._admit(head[0], head[1], step):
                return

    def _admit(self, seq: SchedulerSequence, aged: bool, step: StepBuilder) -> bool:
        """Starts (or resumes) a sequence from its cached prefix: device hits, then tier loads; False if blocks
        lack."""
        bs = self.config.block_size
        long_rope = self.config.long_rope(seq.num_tokens)
        if long_rope != seq.long_rope:  # its blocks' hashes are the other factor set's
            seq.long_rope, seq.block_hashes = long_rope, []
        scored = seq.sampling.prompt_logprobs is not None  # every prompt token is computed (it is scored)
        hits = [] if scored else self._kv.get_computed_blocks(seq)
        tier = self._tier
        loads_pay = tier is not None and tier.cost.loads_pay and not scored
        num_loads = self._kv.count_tier_blocks(seq, len(hits)) if loads_pay else 0
        num_hit_tokens = (len(hits) + num_loads) * bs
        num_tokens = min(seq.num_tokens - num_hit_tokens, step.budget)
        new_ids = self._kv.allocate_slots(seq, num_loads * bs + num_tokens, hits)
        if new_ids is None:
            return False
        loads = tuple(BlockLoad(seq.block_hashes[len(hits) + j], new_ids[j]) for j in range(num_loads))
        self._waiting.remove(seq)
        self._kv.record_prefix_query(seq.num_tokens, num_hit_tokens)
        self._count_hits(seq, num_hit_tokens, num_loads * bs)
        seq.num_admissions += 1
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = num_hit_tokens
        seq.executor_holds = True
        seq.rank = (float("-inf") if aged else float(seq.priority), self._next_admission)
        self._next_admission += 1
        bisect.insort(self._running, seq, key=_rank)
        step.new_seqs.append(
            NewSequence(
                seq_id=seq.seq_id,
                request_id=seq.request_id,
                token_ids=tuple(seq.token_ids),
                num_prompt_tokens=seq.num_prompt_tokens,
                sampling=seq.sampling,
                block_ids=tuple(seq.block_ids),
                num_computed_tokens=num_hit_tokens,
                num_scheduled_tokens=num_tokens,
                structured=seq.structured,
                traceparent=self._tracer.traceparent(seq.seq_id) if self._tracer is not None else "",
                loads=loads,
                long_rope=long_rope,
            )
        )
        step.num_loads += num_loads
        step.commit(seq, num_tokens)
        return True

    def _count_hits(self, seq: SchedulerSequence, num_hit_tokens: int, num_loaded_tokens: int) -> None:
        """Usage counts the first admission's hits (or the one after a failed load); swaps count resumes."""
        if seq.num_admissions == 0 or seq.recount_cached_tokens:
            seq.num_cached_tokens = num_hit_tokens
            seq.num_offloaded_tokens = num_loaded_tokens
            seq.recount_cached_tokens = False
        self._num_offload_hit_tokens += num_loaded_tokens
        if num_loaded_tokens and seq.num_preemptions:
            self._num_swaps += 1

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
            self._kv.cache_full_blocks(seq, entry.num_computed_after)
        if finished:
            self._release(seq)
        return SeqUpdate(seq, token_ids[:num_taken], logprobs[:num_taken], finished)

    def _apply_errors(self, errors: Sequence[SeqError], entries: dict[int, StepEntry]) -> list[SeqUpdate]:
        """Sequences the executor failed: tier misses are recomputed, other errors finish them.

        An error about an earlier admission of a sequence (preempted or recomputed since) is void.
        """
        updates = []
        for err in errors:
            seq = self._seqs.get(err.seq_id)
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
        if self._tier is not None:
            self._tier.forget(block_hashes)
        self._kv.free(seq)
        self._running_dirty = True
        seq.reset_for_recompute()  # the executor holds it no more
        seq.recount_cached_tokens = seq.num_admissions == 1
        seq.status = SequenceStatus.WAITING
        self._waiting.push(seq, front=True)


def _rank(seq: SchedulerSequence) -> tuple[float, int]:
    return seq.rank


def _is_decode(plan: StepPlan, max_batch: int) -> bool:
    """At most max_batch sequences, each computing one token (drafts aside): nothing admitted or prefilled."""
    return (
        not plan.new_seqs
        and len(plan.scheduled_seqs) <= max_batch
        and all(entry.num_scheduled_tokens == 1 for entry in plan.scheduled_seqs)
    )
