"""A step's LoRA deltas: rows grouped by adapter into segments, all segments of a linear layer in one C++ call.

The step's rows are laid out grouped by adapter (``runner.step_batch`` sorts
the decode rows by adapter, then position, and the prefill chunks by adapter),
so each adapter's rows are a contiguous range (two in a step that both decodes
and prefills for it) and the deltas take slices, not gathers: with the
adapters' GEMMs of a SmolLM2-sized qkv layer, an index_select/index_add_ pair
around them cost 1.4-1.8x the slices at 8-64 decode rows and 512 prefill rows
(docs/lora.md). As in Punica and S-LoRA, the base GEMM runs once for all rows;
then each segment adds ``(x[seg] A^T) B^T`` to its rows, in the columns its
adapter covers. Rows of the base model are in no segment and pay nothing.

Where the adapters are packed as the C++ panels (``DeviceLora.grouped``), one
call of ``lora_add_`` (native/csrc/cpu_lora.cpp) adds every segment's delta
of a layer, its work split once over the threads; else each segment runs two
GEMMs through the layer ops' linear (960 small calls a decode step for 8
adapters on 30 layers, each forking the threads: docs/lora.md, "Measured").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from executor_svc.lora.weights import DeviceLora
from executor_svc.native import loader

# (adapter name, first row, end row) of a run of a step's token rows with one adapter.
Segment = tuple[str, int, int]


def adapter_segments(rows: Iterable[tuple[str | None, int]]) -> tuple[Segment, ...]:
    """The segments of a step's rows in order, given (adapter or None, token count) of each attention row;
    consecutive rows of one adapter form one segment, rows of the base model none."""
    segments: list[list[Any]] = []
    row = 0
    for name, count in rows:
        if name is not None:
            if segments and segments[-1][0] == name and segments[-1][2] == row:
                segments[-1][2] += count
            else:
                segments.append([name, row, row + count])
        row += count
    return tuple((name, start, end) for name, start, end in segments)


class LoraStepState:
    """The LoRA deltas of one step (``models.lora_hook.LoraDeltas``): each segment's adapter and rows."""

    # False: every step runs the two-GEMM path (bench/bench_lora.py times both paths in one process).
    grouped_kernel: ClassVar[bool] = True

    def __init__(self, segments: list[tuple[DeviceLora, int, int]], linear: Callable[..., torch.Tensor]):
        self.segments = segments  # (adapter, first row, end row), contiguous row ranges
        self.linear = linear  # the model's layer ops' linear (the adapters are packed for it)
        grouped = self.grouped_kernel and all(adapter.grouped for adapter, _, _ in segments)
        self.lora_add = _lora_add_op() if grouped else None  # the grouped op, or None: two GEMMs per segment

    def targets(self, layer: int, linear: str) -> bool:
        """Whether any adapter of the step adapts ``linear`` of layer ``layer``."""
        return any(linear in adapter.layers[layer] for adapter, _, _ in self.segments)

    def add(self, layer: int, linear: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, out] += each segment's delta of ``linear`` in layer ``layer`` for input x [T, in]."""
        if self.lora_add is not None:
            self._add_grouped(layer, linear, x, out)
            return
        for adapter, start, end in self.segments:
            weights = adapter.layers[layer].get(linear)
            if weights is not None:
                shrunk = self.linear(x[start:end], weights.a)  # [rows, R]
                out[start:end, weights.start : weights.end].add_(self.linear(shrunk, weights.b))

    def _add_grouped(self, layer: int, linear: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``add`` in one call of lora_add_: each segment's panels and (first row, end row, columns) bounds."""
        a_panels, b_panels, bounds = [], [], []
        for adapter, start, end in self.segments:
            weights = adapter.layers[layer].get(linear)
            if weights is not None:
                a_panels.append(weights.a.panels)
                b_panels.append(weights.b.panels)
                bounds += (start, end, weights.start, weights.end)
        if bounds:
            self.lora_add(out, x, a_panels, b_panels, bounds)


@functools.cache
def _lora_add_op() -> Callable[..., None] | None:
    """``torch.ops.pagoda.lora_add_``, or None where the installed kernels predate it."""
    kernels = loader.kernels()
    return None if kernels is None else getattr(kernels.ops, "lora_add_", None)
