"""What one executor's scheduler core holds: its sequences, their KV blocks, its counters.

The bookkeeping half of the core: sequences in and out (add, finish, abort,
take_all) and what they occupy. Planning a step and applying its result
build on it in scheduler.py.

Pure Python: no torch, no numpy, no protos.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from pagoda.step import FinishReason
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request_queue import WaitingQueue
from scheduler_svc.core.scheduler_types import SequenceTracer, SeqUpdate
from scheduler_svc.core.sequence import SchedulerSequence, SequenceStatus
from scheduler_svc.core.step_builder import StepEntry
from scheduler_svc.kv.kv_cache_manager import BlockHasher, KVCacheManager, cdiv, hash_block_tokens
from scheduler_svc.kv.tier_index import TierIndex
from scheduler_svc.spec.speculation import Drafter


class SchedulerState:
    """Waiting and running sequences of one executor, and its KV block accounting."""

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
        # The executor's offload tier as this core knows it (docs/kv-offload.md); None: no tier.
        self._tier = TierIndex(config.block_size, tier_hashes) if config.kv_offload else None
        self._kv = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, block_hasher, self._tier
        )
        self._waiting = WaitingQueue(config.max_priority_wait_s)
        # Sorted by seq.rank: iteration order, and preemption from the tail.
        self._running: list[SchedulerSequence] = []
        self._running_dirty = False
        # Every unfinished sequence, by id.
        self._seqs: dict[int, SchedulerSequence] = {}
        self._dropped: list[int] = []
        # step_id -> seq_id -> entry, for plans whose result has not arrived.
        self._inflight: dict[int, dict[int, StepEntry]] = {}
        self._next_step_id = 0
        self._next_admission = 0
        self._num_preemptions = 0
        # Sequences recomputed on LongRoPE's long factors after growing past the switch length.
        self.num_rope_restarts = 0
        # Offload tier: prompt tokens loaded instead of computed, preempted sequences resumed by loads
        # (swaps), and loads each plan in flight asked for (for the cost model).
        self._num_offload_hit_tokens = 0
        self._num_swaps = 0
        self._plan_loads: dict[int, int] = {}
        self._drafter: Drafter | None = None
        if config.speculative != "off":
            self._drafter = Drafter(config, self._kv)
        # Steps in flight that verify drafts -> whether they measure the draft model's cost (Drafter.on_step).
        self._draft_steps: dict[int, bool] = {}
        # Steps in flight of decode only (one token per sequence) -> their number of sequences (speculation on).
        self._decode_batches: dict[int, int] = {}

    # -- state ----------------------------------------------------------------

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self._kv

    @property
    def running(self) -> list[SchedulerSequence]:
        """Running sequences in rank order (do not modify)."""
        self._compact_running()
        return self._running

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_blocks(self) -> int:
        return self._kv.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self._kv.usage

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def tier(self) -> TierIndex | None:
        """The executor's offload tier as this core knows it (None: no tier)."""
        return self._tier

    @property
    def num_offload_hit_tokens(self) -> int:
        """Prompt (or resumed) tokens loaded from the offload tier instead of computed."""
        return self._num_offload_hit_tokens

    @property
    def num_swaps(self) -> int:
        """Preempted sequences resumed by loading their blocks from the offload tier."""
        return self._num_swaps

    @property
    def prefix_cache_queries(self) -> int:
        return self._kv.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self._kv.prefix_cache_hits

    @property
    def num_inflight_steps(self) -> int:
        """Plans with work whose result has not arrived."""
        return len(self._inflight)

    @property
    def drafter(self) -> Drafter | None:
        """The speculation policy and its counters (None: speculation off)."""
        return self._drafter

    @property
    def may_plan_ahead(self) -> bool:
        """Whether the next plan may be built before the last one's result arrives.

        Not while a step verifying drafts is in flight (how many tokens it adds is
        unknown), nor while a sequence would draft (drafts follow the known tokens).
        """
        if self._draft_steps:
            return False
        drafter = self._drafter
        if drafter is None or not drafter.allows(len(self.running)):
            return True
        return not any(drafter.wants(seq) for seq in self.running)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id: int) -> SchedulerSequence | None:
        """The unfinished sequence with this id, or None."""
        return self._seqs.get(seq_id)

    def can_fit(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a request could ever run here: within max_model_len and the whole pool."""
        num_tokens = num_prompt_tokens + max_tokens
        return (
            num_prompt_tokens > 0
            and max_tokens > 0
            and num_tokens <= self.config.max_model_len
            and cdiv(num_tokens, self.config.block_size) <= self.config.num_blocks
        )

    def peek_prefix_hit_tokens(self, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Prompt tokens the prefix cache would serve now (for the router); no side effects."""
        return self._kv.peek_prefix_hit_tokens(token_ids, cache_salt, self.config.long_rope(len(token_ids)))

    # -- requests in and out ----------------------------------------------------

    def add(self, seq: SchedulerSequence) -> None:
        """Queues a sequence: new, or taken from another scheduler (then at its priority's head).

        Raises:
            ValueError: the id is in use, or the request can never fit (see can_fit).
        """
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq_id {seq.seq_id} is already scheduled")
        if not self.can_fit(seq.num_prompt_tokens, seq.stopping.max_tokens):
            raise ValueError(
                f"{seq.num_prompt_tokens} prompt + {seq.stopping.max_tokens} max tokens cannot fit "
                f"(max_model_len {self.config.max_model_len}, "
                f"{self.config.num_blocks} blocks of {self.config.block_size})"
            )
        if seq.arrival_time_s is None:
            seq.arrival_time_s = self._clock()
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self._waiting.push(seq, front=seq.num_admissions > 0)

    def finish(self, seq_id: int, reason: FinishReason, stop_reason: int | None = None) -> None:
        """Stops a sequence (stop string, error); its blocks are freed now. Unknown id: no-op."""
        seq = self._seqs.get(seq_id)
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
        seqs = list(self.running) + self._waiting.ordered()
        for seq in seqs:
            seq.reset_for_recompute()
            seq.num_pending_tokens = 0
            seq.status = SequenceStatus.WAITING
        self._kv.reset()
        self._waiting = WaitingQueue(self.config.max_priority_wait_s)
        self._running = []
        self._seqs = {}
        self._dropped = []
        self._inflight = {}
        self._plan_loads = {}
        self._draft_steps.clear()
        self._decode_batches.clear()
        if self._drafter is not None:
            self._drafter.forget_all()
        return seqs

    def _fail(self, seq_id: int, message: str) -> SeqUpdate:
        seq = self._seqs[seq_id]
        seq.error_message = message
        self.finish(seq_id, FinishReason.ERROR)
        return SeqUpdate(seq, (), (), True)

    def _release(self, seq: SchedulerSequence) -> None:
        """Finishes a sequence: frees its blocks (full ones stay cached), schedules its drop."""
        if seq.status is SequenceStatus.RUNNING:
            self._kv.free(seq)
            self._running_dirty = True
        else:
            self._waiting.remove(seq)
        if seq.executor_holds:
            self._dropped.append(seq.seq_id)
            seq.executor_holds = False
        seq.status = SequenceStatus.FINISHED
        del self._seqs[seq.seq_id]
        if self._drafter is not None:
            self._drafter.forget(seq.seq_id)

    def _compact_running(self) -> None:
        if self._running_dirty:
            self._running = [seq for seq in self._running if seq.status is SequenceStatus.RUNNING]
            self._running_dirty = False
