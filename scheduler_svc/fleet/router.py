"""Pick the executor for a new request: cached prefix first, then least loaded."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.fleet.executor_handle import ExecutorHandle

# A prefix hit wins over load only while the holder is not this much busier.
MAX_LOAD_GAP_FOR_PREFIX = 8


def choose_executor(
    executors: Sequence[ExecutorHandle], token_ids: Sequence[int], cache_salt: str = ""
) -> tuple[ExecutorHandle, int]:
    """Return (executor, cached prefix tokens it holds) among executors that accept new sequences."""
    candidates = [e for e in executors if e.accepts_new]
    if not candidates:
        raise LookupError("no executor accepts new sequences")
    least = min(candidates, key=lambda e: e.load())
    hits = [(_prefix_hit_tokens(e, token_ids, cache_salt), e) for e in candidates]
    best_hit, best = max(hits, key=lambda h: (h[0], -h[1].load()[0]))
    if best_hit > 0 and best.load()[0] - least.load()[0] <= MAX_LOAD_GAP_FOR_PREFIX:
        return best, best_hit
    return least, next(h for h, e in hits if e is least)


def _prefix_hit_tokens(executor: ExecutorHandle, token_ids: Sequence[int], cache_salt: str) -> int:
    assert executor.scheduler is not None  # accepts_new
    return executor.scheduler.peek_prefix_hit_tokens(token_ids, cache_salt)
