"""The runner's side of LoRA: each sequence's adapter, made resident when the sequence arrives, and each step's
deltas.

A new sequence names its adapter once (``SequenceState.lora_name``); it is
made resident then, and stays resident while the runner holds the sequence
(the registry asks ``in_use`` before it evicts). A sequence whose adapter is
unknown, no longer fits, or finds every slot held by running sequences fails
alone, with a message that says which.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.lora.batch import LoraStepState, Segment
from executor_svc.lora.errors import LoraAdapterError, LoraRegistryError
from executor_svc.lora.registry import LoraRegistry
from executor_svc.serving.sequence_table import Scheduled, SequenceState
from pagoda.step import SeqError, StepPlan


def in_use(seqs: dict[int, SequenceState]) -> set[str]:
    """The adapters of the sequences a runner holds."""
    return {state.lora_name for state in seqs.values() if state.lora_name is not None}


def admit(
    registry: LoraRegistry,
    seqs: dict[int, SequenceState],
    step: StepPlan,
    scheduled: Scheduled,
    errors: list[SeqError],
) -> Scheduled:
    """Makes the adapter of each new sequence of ``step`` (``SequenceState.lora_name``, from the plan)
    resident; a sequence that cannot have it is dropped with an error. Returns what still runs."""
    failed = set()
    for new in step.new_seqs:
        state = seqs.get(new.seq_id)
        if state is None:  # refused by the plan checks
            continue
        reason = None if state.lora_name is None else _acquire(registry, state.lora_name)
        if reason is not None:
            del seqs[new.seq_id]
            errors.append(SeqError(new.seq_id, reason))
            failed.add(new.seq_id)
    return [(state, n) for state, n in scheduled if state.seq_id not in failed] if failed else scheduled


def step_deltas(
    registry: LoraRegistry, segments: tuple[Segment, ...], linear: Callable[..., torch.Tensor]
) -> LoraStepState:
    """The deltas of a step's adapter segments (``StepBatch.lora_segments``), for the model's layer ops."""
    return LoraStepState([(registry.resident(name), start, end) for name, start, end in segments], linear)


def _acquire(registry: LoraRegistry, name: str) -> str | None:
    """None once adapter ``name`` is resident, else why it cannot be."""
    try:
        if registry.acquire(name):
            return None
    except (LoraAdapterError, LoraRegistryError) as exc:
        return f"LoRA: {exc}"
    return (
        f"LoRA adapter {name!r} cannot be loaded now: all {registry.max_loras} slots (max_loras) hold adapters of "
        "running sequences"
    )
