"""Pick the executor for a new request: cached prefix first, then least loaded."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from scheduler_svc.executor_worker import ExecutorWorker

# A prefix hit wins over load only while the holder is not this much busier.
MAX_LOAD_GAP_FOR_PREFIX = 8


def choose_worker(
    workers: Seq[ExecutorWorker], token_ids: Seq[int], cache_salt: str = ""
) -> tuple[ExecutorWorker, int]:
    """Return (worker, cached prefix tokens it holds) among workers that accept new sequences."""
    candidates = [w for w in workers if w.accepts_new]
    if not candidates:
        raise LookupError("no executor accepts new sequences")
    least = min(candidates, key=lambda w: w.load())
    hits = [(w.scheduler.peek_prefix_hit_tokens(token_ids, cache_salt), w) for w in candidates]
    best_hit, best = max(hits, key=lambda h: (h[0], -h[1].load()[0]))
    if best_hit > 0 and best.load()[0] - least.load()[0] <= MAX_LOAD_GAP_FOR_PREFIX:
        return best, best_hit
    return least, next(h for h, w in hits if w is least)
