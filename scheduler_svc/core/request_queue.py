"""The waiting queue: priority (lower first), FCFS within a priority, with aging.

Two heaps over the same sequences, with lazy deletion: one ordered by
(priority, order), one by arrival time. A sequence that has waited longer than
max_wait_s is served first, oldest first, whatever its priority, so a low
priority cannot starve. Preempted sequences go to the head of their priority.
"""

from __future__ import annotations

import heapq

from scheduler_svc.core.sequence import SchedulerSequence

# (priority or arrival time, order, seq_id): both heaps order by the first two.
HeapEntry = tuple[float, int, int]


class WaitingQueue:
    """Sequences waiting for admission."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        # (priority, order, seq_id)
        self._by_priority: list[HeapEntry] = []
        # (arrival_time_s, order, seq_id)
        self._by_arrival: list[HeapEntry] = []
        # seq_id -> (order of its live heap entries, seq); others are stale.
        self._entries: dict[int, tuple[int, SchedulerSequence]] = {}
        self._next_order = 0
        self._next_front_order = -1

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, seq: SchedulerSequence, front: bool = False) -> None:
        """Adds a sequence at the back of its priority, or at its head (front)."""
        if front:
            order, self._next_front_order = self._next_front_order, self._next_front_order - 1
        else:
            order, self._next_order = self._next_order, self._next_order + 1
        self._entries[seq.seq_id] = (order, seq)
        assert seq.arrival_time_s is not None  # Scheduler.add sets it
        heapq.heappush(self._by_priority, (seq.priority, order, seq.seq_id))
        heapq.heappush(self._by_arrival, (seq.arrival_time_s, order, seq.seq_id))

    def remove(self, seq: SchedulerSequence) -> None:
        """Takes a sequence out (admitted, finished or aborted); O(1)."""
        self._entries.pop(seq.seq_id, None)

    def peek(self, now_s: float) -> tuple[SchedulerSequence, bool] | None:
        """The next sequence to admit and whether it is aged, or None if empty."""
        self._drop_stale(self._by_arrival)
        if self._by_arrival:
            arrival_s, _, seq_id = self._by_arrival[0]
            if now_s - arrival_s > self.max_wait_s:
                return self._entries[seq_id][1], True
        self._drop_stale(self._by_priority)
        if self._by_priority:
            return self._entries[self._by_priority[0][2]][1], False
        return None

    def ordered(self) -> list[SchedulerSequence]:
        """All waiting sequences in priority order (ignoring aging)."""
        live = sorted((seq.priority, order, seq.seq_id) for order, seq in self._entries.values())
        return [self._entries[seq_id][1] for _, _, seq_id in live]

    def _drop_stale(self, heap: list[HeapEntry]) -> None:
        entries = self._entries
        while heap:
            entry = entries.get(heap[0][2])
            if entry is not None and entry[0] == heap[0][1]:
                return
            heapq.heappop(heap)
