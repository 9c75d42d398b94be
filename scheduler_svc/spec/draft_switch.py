"""The draft model switched off for every sequence where it cannot pay, and tried again now and then.

The per-sequence policy (scheduler_svc.spec.speculation) pauses the draft model for a
sequence whose drafts do not pay; a new sequence would still try it, and its
first attempt also catches the draft model's KV up on the whole prompt, which
for a draft model as large as the model is a second prefill. So once the draft
model cannot pay at all (its measured cost leaves nothing to gain even with
every draft accepted), or every sequence trying it has paused it, it goes off:
no sequence, a new one neither, asks for it. At the start, and after
``FIRST_OFF_STEPS`` steps off, one sequence tries it (the probe: the shortest
of those whose own record lets them, so the least to catch up on), the others
waiting for its verdict; off again after an attempt, it stays off twice as
long, at most ``MAX_OFF_STEPS``. Once an attempt with a measured cost leaves a
sequence drafting (it pays), every sequence may try it and the time off starts
again at the first. With one sequence of several drafting, the cost measured
is at most what it is with all drafting (fewer rows), so a probe that finds
it too costly is right for the whole batch.

Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler_svc.core.sequence import SchedulerSequence

# Steps the draft model stays off, first and at most (doubling each time it goes off after an attempt).
FIRST_OFF_STEPS = 256
MAX_OFF_STEPS = 8192


class DraftModelSwitch:
    """Whether the draft model runs, for which sequences, and when it is tried again."""

    def __init__(self, on: bool, paused: Callable[[SchedulerSequence], bool], trusted: bool = False) -> None:
        """``paused``: whether a sequence's own record has paused the draft model (the drafter keeps the records)."""
        self.on = on
        self._paused = paused
        # Every sequence may try it (once it has paid, or always: not adaptive); else only the probe.
        self.trusted = trusted
        self.probe_id: int | None = None
        self.off_steps = FIRST_OFF_STEPS
        self._back_at = 0
        self._attempted = False

    def allows(self, seq: SchedulerSequence) -> bool:
        """Whether seq may draft with the draft model (its own record aside)."""
        return self.on and (self.trusted or seq.seq_id == self.probe_id)

    def update(self, running: Sequence[SchedulerSequence], num_steps: int, cannot_pay: bool) -> bool:
        """Before a step is planned: off where it cannot pay, on for a probe when its time off is over.

        Returns whether it went on again (its cost is then to be measured afresh).
        """
        drafting = [seq for seq in running if seq.structured is None]
        candidates = [seq for seq in drafting if not self._paused(seq)]
        if not self.trusted and not any(seq.seq_id == self.probe_id for seq in candidates):
            # No probe (at the start, after a time off), or it is gone or paused before it paid.
            if self.on and self._attempted:
                self._go_off(num_steps)
            elif num_steps >= self._back_at and candidates:
                went_on, self.on, self._attempted = not self.on, True, False
                self.probe_id = min(candidates, key=lambda seq: len(seq.token_ids)).seq_id
                return went_on
            else:
                self.on = False
            return False
        if self.on and (cannot_pay or (self.trusted and drafting and not candidates)):
            self._go_off(num_steps)
        return False

    def attempted(self, pays: bool) -> None:
        """A sequence drafted with it; ``pays``: its cost measured, the sequence keeps drafting."""
        self._attempted = True
        if pays:
            self.trusted, self.probe_id, self.off_steps = True, None, FIRST_OFF_STEPS

    def _go_off(self, num_steps: int) -> None:
        self.on, self.trusted, self.probe_id = False, False, None
        self._back_at = num_steps + self.off_steps
        if self._attempted:  # tried and lost again: twice as long next time
            self.off_steps = min(2 * self.off_steps, MAX_OFF_STEPS)
