"""Plans sent to the executor whose results have not arrived, with what applying each result needs.

Pure Python: no torch, no numpy, no protos.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.step_builder import StepEntry


@dataclass(slots=True)
class InflightStep:
    """One plan with work, as the scheduler planned it."""

    # seq_id -> what the plan asked of the sequence.
    entries: dict[int, StepEntry]
    # It verifies drafts: whether it measures the draft model's cost (Drafter.on_step); None: no drafts.
    drafts: bool | None = None
    # Decode only with speculation on: its number of sequences (0: another kind of step).
    decode_batch: int = 0
    # Blocks it loads from the offload tier (for the tier's cost model).
    num_loads: int = 0


class InflightSteps:
    """The plans in flight by step_id (the engine keeps at most two)."""

    def __init__(self) -> None:
        self._steps: dict[int, InflightStep] = {}

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step_id: int, step: InflightStep) -> None:
        self._steps[step_id] = step

    def pop(self, step_id: int) -> InflightStep | None:
        """The plan of a result (None: it had no work, or it was sent before clear())."""
        return self._steps.pop(step_id, None)

    def entries(self, step_id: int) -> dict[int, StepEntry]:
        """What the plan in flight asked of each sequence (empty: no such plan)."""
        step = self._steps.get(step_id)
        return step.entries if step is not None else {}

    @property
    def verifying_drafts(self) -> bool:
        """Whether a plan in flight verifies drafts (how many tokens it adds is unknown until it returns)."""
        return any(step.drafts is not None for step in self._steps.values())

    def clear(self) -> None:
        self._steps.clear()
