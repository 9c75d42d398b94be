"""An adapter on the device, laid out for the step: one A and one B matrix per fused linear layer it adapts.

The modules of one fused layer become one pair: their A matrices stacked
([r_q + r_k + r_v, in]) and their B matrices side by side in a block matrix
over the columns they cover, each module's scale folded in (zeros where a
module's rows meet another module's ranks, and for a module in between that
the adapter leaves alone). So the delta of a fused layer is two GEMMs, the
second writing a contiguous range of its columns. Both are packed by the
model's layer ops (never quantized). Where that gives the C++ panels
(``PanelWeight``: bf16 on AVX512-BF16 or AMX, fp32 on AVX-512), the grouped
op ``lora_add_`` (native/csrc/cpu_lora.cpp) reads them as they are and adds
every segment's delta of a layer in one call (``lora.batch``); elsewhere they
run through the layer ops' linear like the base weights. Weights are in the
model's dtype (bf16 adapters for bf16 and int8 models, fp32 for an fp32 model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from executor_svc.lora.adapter import LoraAdapter, LoraModule
from executor_svc.models.layer_ops import WIDENED_F32_PANEL, PanelWeight

# A weight [out, in] -> the form the layer ops' linear takes (LayerOps.pack with dense=True).
Packer = Callable[[torch.Tensor], Any]


@dataclasses.dataclass(frozen=True)
class LoraLinear:
    """An adapter's delta on one fused linear layer of one layer: ``out[:, start:end] += (x a^T) b^T``."""

    a: Any  # [R, in], packed (R: the ranks of the modules it covers, summed)
    b: Any  # [end - start, R], packed, scales folded in
    start: int  # the first output column it adds to
    end: int


@dataclasses.dataclass(frozen=True)
class DeviceLora:
    """A resident adapter: per layer, the fused linear layers it adapts (``models.lora_hook.LINEARS``)."""

    name: str
    layers: list[dict[str, LoraLinear]]
    num_bytes: int  # of its matrices on the device
    grouped: bool  # every pair is in the panels lora_add_ reads (native/csrc/cpu_lora.cpp), in the model's dtype


def to_device(
    name: str, adapter: LoraAdapter, num_layers: int, pack: Packer, dtype: torch.dtype, device: torch.device
) -> DeviceLora:
    """The adapter's device form, in ``dtype``, packed with ``pack``."""
    grouped: dict[tuple[int, str], list[LoraModule]] = {}
    for (layer, _), module in adapter.modules.items():
        grouped.setdefault((layer, module.target.linear), []).append(module)
    layers: list[dict[str, LoraLinear]] = [{} for _ in range(num_layers)]
    num_bytes, panels = 0, True
    for (layer, linear), modules in grouped.items():
        a, b, start = _fused_pair(sorted(modules, key=lambda m: m.target.column_start))
        a, b = a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)
        num_bytes += (a.numel() + b.numel()) * a.element_size()
        pair = LoraLinear(pack(a), pack(b), start, start + b.shape[0])
        panels = panels and _kernel_panels(pair.a, dtype) and _kernel_panels(pair.b, dtype)
        layers[layer][linear] = pair
    return DeviceLora(name, layers, num_bytes, panels)


def _kernel_panels(packed: Any, dtype: torch.dtype) -> bool:
    """Whether ``packed`` is a matrix as pack_bf16 / pack_f32 lay it out, in ``dtype`` (not bf16 widened to fp32),
    for the vector code of the LoRA kernel: its fp32 blocks are AVX-512 (on AVX2 alone they are scalar loops, so
    the adapters run as two panel GEMMs per layer instead)."""
    if not isinstance(packed, PanelWeight) or packed.path == WIDENED_F32_PANEL or packed.panels.dtype != dtype:
        return False
    return packed.path != "avx2-panel"


def _fused_pair(modules: list[LoraModule]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(A [R, in], scaled block B [columns, R], first column) of the modules of one fused layer, in fp32."""
    start = modules[0].target.column_start
    end = max(m.target.column_start + m.target.out_features for m in modules)
    a = torch.cat([m.a.float() for m in modules])
    b = torch.zeros(end - start, a.shape[0])
    rank_offset = 0
    for m in modules:
        row = m.target.column_start - start
        b[row : row + m.target.out_features, rank_offset : rank_offset + m.rank] = m.b.float() * m.scale
        rank_offset += m.rank
    return a, b, start
