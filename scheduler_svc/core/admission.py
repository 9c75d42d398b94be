"""Admission: waiting sequences start (or resume) from their cached prefix, while budget, seats and blocks last.

A sequence's cached prefix is its device hits (the prefix cache), then blocks the
executor's offload tier holds when loading them pays (the tier's cost model); the
rest of its prompt is scheduled in this step's budget, chunked when it is longer.

Pure Python: no torch, no numpy, no protos.
"""

from __future__ import annotations

from pagoda.step import BlockLoad, NewSequence
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.roster import Roster
from scheduler_svc.core.scheduler_types import SchedulerCounters, SequenceTracer
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.core.step_builder import StepBuilder
from scheduler_svc.kv.kv_cache_manager import KVCacheManager
from scheduler_svc.kv.tier_index import TierIndex


class Admission:
    """Admits the waiting sequences of one scheduler core into its steps."""

    def __init__(
        self,
        config: SchedulerConfig,
        roster: Roster,
        kv: KVCacheManager,
        tier: TierIndex | None,
        counters: SchedulerCounters,
        tracer: SequenceTracer | None,
    ) -> None:
        self._config = config
        self._roster = roster
        self._kv = kv
        self._tier = tier
        self._counters = counters
        self._tracer = tracer

    def admit_waiting(self, step: StepBuilder, now_s: float) -> None:
        """Admits waiting sequences in order while budget, seats and blocks last.

        A head whose LoRA adapter would be one more than the executor's ``max_loras`` distinct adapters
        among the running sequences waits; those behind it whose adapter runs already (or the base model)
        go ahead, unless the head has waited past the aging limit: then nothing is admitted until a slot
        frees, so a busy adapter cannot starve another.
        """
        while step.budget > 0 and len(self._roster.running) < self._config.max_num_seqs:
            head = self._roster.waiting.peek(now_s)
            # A preempted sequence waits for its pending token before it resumes.
            if head is None or head[0].num_pending_tokens:
                return
            if not self._lora_fits(head[0]):
                if not head[1]:
                    self._admit_running_adapters(step)
                return
            if not self._admit(head[0], head[1], step):
                return

    def _lora_fits(self, seq: SchedulerSequence) -> bool:
        """Whether seq's adapter runs already, or a slot is free for it (always, for the base model)."""
        limit = self._config.max_loras
        if not seq.lora_name or not limit:
            return True
        running = {s.lora_name for s in self._roster.running if s.lora_name}
        return seq.lora_name in running or len(running) < limit

    def _admit_running_adapters(self, step: StepBuilder) -> None:
        """Admits, in queue order, the waiting sequences of the base model and of adapters that run already."""
        for seq in self._roster.waiting.ordered():
            if step.budget <= 0 or len(self._roster.running) >= self._config.max_num_seqs:
                return
            if seq.num_pending_tokens or not self._lora_fits(seq):  # every slot is taken: only those fit
                continue
            if not self._admit(seq, False, step):
                return

    def _admit(self, seq: SchedulerSequence, aged: bool, step: StepBuilder) -> bool:
        """Starts (or resumes) a sequence from its cached prefix: device hits, then tier loads; False if blocks
        lack."""
        bs = self._config.block_size
        long_rope = self._config.long_rope(seq.num_tokens)
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
        self._roster.start(seq, aged)
        self._kv.record_prefix_query(seq.num_tokens, num_hit_tokens)
        self._count_hits(seq, num_hit_tokens, num_loads * bs)
        seq.num_admissions += 1
        seq.num_computed_tokens = num_hit_tokens
        seq.executor_holds = True
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
                lora_name=seq.lora_name,
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
        self._counters.num_offload_hit_tokens += num_loaded_tokens
        if num_loaded_tokens and seq.num_preemptions:
            self._counters.num_swaps += 1
