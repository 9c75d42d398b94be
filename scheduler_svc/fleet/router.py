"""Pick the executor for a new request: cached prefix first, then least loaded (or, packed, most loaded).

When this scheduler is the limit (its executors wait for plans), spreading new
requests over every idle executor makes more, smaller steps, and the scheduler
pays its per-step cost for fewer tokens each: throughput falls as executors are
added. Then new requests are packed instead: onto the busiest executor that
still has room (sequences below max_num_seqs, KV cache below PACK_MAX_KV_USAGE),
so steps carry more tokens. Once the scheduler keeps up, routing spreads again.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.fleet.executor_handle import ExecutorHandle

# A prefix hit wins over load only while the holder is not this much busier.
MAX_LOAD_GAP_FOR_PREFIX = 8
# Packing stops adding to an executor whose KV cache is this full (it would preempt).
PACK_MAX_KV_USAGE = 0.8


def choose_executor(
    executors: Sequence[ExecutorHandle],
    token_ids: Sequence[int],
    cache_salt: str = "",
    pack: bool = False,
    lora: str = "",
) -> tuple[ExecutorHandle, int]:
    """Return (executor, cached prefix tokens it holds) among executors that accept new sequences.

    `pack`: the scheduler is the bottleneck; prefer the busiest executor with room over the least loaded.
    `lora`: the fingerprint of the sequence's LoRA adapter (its prefix hits are that adapter's blocks).
    """
    candidates = [e for e in executors if e.accepts_new]
    if not candidates:
        raise LookupError("no executor accepts new sequences")
    least = _packed(candidates) if pack else None
    least = least or min(candidates, key=lambda e: e.load())
    hits = [(_prefix_hit_tokens(e, token_ids, cache_salt, lora), e) for e in candidates]
    best_hit, best = max(hits, key=lambda h: (h[0], -h[1].load()[0]))
    if best_hit > 0 and best.load()[0] - least.load()[0] <= MAX_LOAD_GAP_FOR_PREFIX:
        return best, best_hit
    return least, next(h for h, e in hits if e is least)


def _packed(candidates: Sequence[ExecutorHandle]) -> ExecutorHandle | None:
    """The busiest executor that runs something and has room for one more sequence, if any."""
    roomy = [e for e in candidates if 0 < e.load()[0] < _capacity(e) and e.load()[1] < PACK_MAX_KV_USAGE]
    return max(roomy, key=lambda e: e.load()) if roomy else None


def _capacity(executor: ExecutorHandle) -> int:
    assert executor.scheduler is not None  # accepts_new
    return executor.scheduler.config.max_num_seqs


def _prefix_hit_tokens(executor: ExecutorHandle, token_ids: Sequence[int], cache_salt: str, lora: str) -> int:
    assert executor.scheduler is not None  # accepts_new
    return executor.scheduler.peek_prefix_hit_tokens(token_ids, cache_salt, lora)
