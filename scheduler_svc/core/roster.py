"""Where each unfinished sequence of one executor is: waiting in its queue, or running in rank order.

The roster moves sequences between the two and remembers which ones the
executor must drop; it knows nothing of KV blocks, drafts or steps (the
scheduler frees and plans; see scheduler.py).

Pure Python: no torch, no numpy, no protos.
"""

from __future__ import annotations

import bisect

from scheduler_svc.core.request_queue import WaitingQueue
from scheduler_svc.core.sequence import SchedulerSequence, SequenceStatus


class Roster:
    """Every unfinished sequence by id, the waiting queue, the running list, and ids to drop."""

    def __init__(self, max_priority_wait_s: float) -> None:
        self.waiting = WaitingQueue(max_priority_wait_s)
        # Sorted by seq.rank: iteration order, and preemption from the tail. Sequences that left running
        # (status no longer RUNNING) are filtered out lazily, on the next read.
        self._running: list[SchedulerSequence] = []
        self._running_dirty = False
        self._seqs: dict[int, SchedulerSequence] = {}
        # Sequences the executor holds KV for and must drop with the next plan.
        self._dropped: list[int] = []
        self._next_admission = 0

    @property
    def running(self) -> list[SchedulerSequence]:
        """Running sequences in rank order (the list itself: only the roster changes it)."""
        if self._running_dirty:
            self._running = [seq for seq in self._running if seq.status is SequenceStatus.RUNNING]
            self._running_dirty = False
        return self._running

    def __len__(self) -> int:
        """Unfinished sequences, waiting or running."""
        return len(self._seqs)

    def get(self, seq_id: int) -> SchedulerSequence | None:
        return self._seqs.get(seq_id)

    def add(self, seq: SchedulerSequence, front: bool) -> None:
        """A new (or moved-in) sequence waits; ``front``: at the head of its priority."""
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.push(seq, front=front)

    def start(self, seq: SchedulerSequence, aged: bool) -> None:
        """A waiting sequence runs, ranked after everything admitted before it at its priority (or first when
        ``aged``: it waited past the queue's limit)."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.rank = (float("-inf") if aged else float(seq.priority), self._next_admission)
        self._next_admission += 1
        bisect.insort(self.running, seq, key=_rank)

    def preempt_tail(self) -> SchedulerSequence:
        """Takes the lowest-ranked running sequence out of running and requeues it (its KV blocks are freed).

        The running list stays the same object, so a caller iterating over it sees the tail go.
        """
        seq = self.running.pop()
        self._wait_again(seq)
        return seq

    def requeue(self, seq: SchedulerSequence) -> None:
        """A running sequence waits again at the head of its priority, to be recomputed (its blocks are freed)."""
        self._running_dirty = True
        self._wait_again(seq)

    def _wait_again(self, seq: SchedulerSequence) -> None:
        if seq.executor_holds:
            self._dropped.append(seq.seq_id)
        seq.reset_for_recompute()
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq, front=True)

    def finish(self, seq: SchedulerSequence) -> None:
        """Takes a finished sequence out of wherever it is; the executor drops it if it holds it."""
        if seq.status is SequenceStatus.RUNNING:
            self._running_dirty = True
        else:
            self.waiting.remove(seq)
        if seq.executor_holds:
            self._dropped.append(seq.seq_id)
            seq.executor_holds = False
        seq.status = SequenceStatus.FINISHED
        del self._seqs[seq.seq_id]

    def take_dropped(self) -> tuple[int, ...]:
        """Ids the next plan tells the executor to drop (and forgets them)."""
        dropped, self._dropped = tuple(self._dropped), []
        return dropped

    def take_all(self) -> list[SchedulerSequence]:
        """Every unfinished sequence, running ones first, in order; the roster is empty after."""
        seqs = list(self.running) + self.waiting.ordered()
        self.waiting = WaitingQueue(self.waiting.max_wait_s)
        self._running, self._seqs, self._dropped = [], {}, []
        return seqs


def _rank(seq: SchedulerSequence) -> tuple[float, int]:
    return seq.rank
