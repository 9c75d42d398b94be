"""The grouped LoRA op (native/csrc/cpu_lora.cpp) against a float64 reference, and the step's choice of it.

``lora_add_`` adds every adapter segment's ``(x[rows] A^T) B^T`` of one fused
layer in one call. Layouts: one row; decode rows of 8 adapters with ranks 1
to 64 and column ranges with tails; empty segments; base rows between
segments (left bit for bit); a 300-row prefill at a fused rank of 192; input
widths that are not a multiple of 32 (x copied to the padded pairs) and
strided x and out. fp32 is held to float64 within 2e-6 of the largest value;
bf16 rounds the shrunk rows to bf16 as the two-GEMM path does, then adds in
fp32 and rounds once.
"""

from __future__ import annotations

import functools

import pytest
import torch

from executor_svc.lora.adapter import LoraAdapter, LoraModule
from executor_svc.lora.batch import LoraStepState
from executor_svc.lora.targets import LoraTarget
from executor_svc.lora.weights import to_device
from executor_svc.models.layer_ops import CppLayerOps, TorchLayerOps
from executor_svc.models.lora_hook import GATE_UP, QKV

CPU = torch.device("cpu")

# (rows T, in K, out N, segments: (first row, end row, first column, end column, rank)).
LAYOUTS = {
    "one row": (1, 576, 960, [(0, 1, 0, 960, 16)]),
    "decode, 8 adapters": (
        64,
        576,
        960,
        [
            (8 * i, 8 * i + 8, c0, c1, r)
            for i, (c0, c1, r) in enumerate(
                [
                    (0, 960, 16),
                    (0, 576, 48),
                    (576, 960, 64),
                    (100, 337, 1),
                    (0, 17, 8),
                    (959, 960, 5),
                    (64, 832, 33),
                    (0, 960, 64),
                ]
            )
        ],
    ),  # fmt: skip
    "empty segments and base rows": (
        20,
        64,
        200,
        [(0, 0, 0, 200, 4), (2, 5, 0, 128, 4), (5, 5, 10, 20, 2), (6, 13, 64, 200, 16), (19, 20, 3, 4, 7)],
    ),
    "prefill at rank 192": (300, 576, 3072, [(0, 300, 0, 3072, 192)]),
    "in features not a multiple of 32": (13, 72, 100, [(0, 7, 0, 100, 16), (7, 13, 40, 99, 12)]),
}
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-7}


def _pack(kernel, weight: torch.Tensor) -> torch.Tensor:
    return kernel.pack_bf16(weight) if weight.dtype == torch.bfloat16 else kernel.pack_f32(weight)


def _layout(name: str, dtype: torch.dtype, strided: bool = False):
    """x [T, K], out [T, N] (views of wider tensors when ``strided``) and each segment's (A, B, bounds)."""
    rows, in_features, out_features, specs = LAYOUTS[name]
    gen = torch.Generator().manual_seed(len(name) * 31 + rows)
    pad = 5 if strided else 0
    x = torch.randn(rows, in_features + pad, generator=gen).to(dtype)[:, pad:]
    out = torch.randn(rows, out_features + 2 * pad, generator=gen).to(dtype)[:, pad : pad + out_features]
    pairs = [
        (
            (torch.randn(rank, in_features, generator=gen) * 0.1).to(dtype),
            (torch.randn(c1 - c0, rank, generator=gen) * 0.1).to(dtype),
            (start, end, c0, c1),
        )
        for start, end, c0, c1, rank in specs
    ]
    return x, out, pairs


def _reference(x: torch.Tensor, out: torch.Tensor, pairs) -> torch.Tensor:
    """out + each segment's delta in float64 (the shrunk rows rounded to x's dtype, as both paths round them)."""
    expected = out.double()
    for a, b, (start, end, c0, c1) in pairs:
        shrunk = (x[start:end].double() @ a.double().T).to(x.dtype).double()
        expected[start:end, c0:c1] += shrunk @ b.double().T
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("strided", [False, True])
def test_lora_add_equals_the_reference(cpp_kernel, layout, dtype, strided):
    x, out, pairs = _layout(layout, dtype, strided)
    before = out.clone()
    expected = _reference(x, out, pairs)
    bounds = [bound for _, _, segment in pairs for bound in segment]
    cpp_kernel.lora_add_(
        out, x, [_pack(cpp_kernel, a) for a, _, _ in pairs], [_pack(cpp_kernel, b) for _, b, _ in pairs], bounds
    )
    tol = TOLERANCE[dtype]
    assert (out.double() - expected).abs().max().item() <= tol * max(1.0, expected.abs().max().item())
    moved = torch.zeros(out.shape, dtype=torch.bool)
    for _, _, (start, end, c0, c1) in pairs:
        moved[start:end, c0:c1] = True
    assert torch.equal(out[~moved], before[~moved])  # base rows, and columns no adapter covers: untouched
    if any(end > start for _, _, (start, end, _, _) in pairs):
        assert not torch.equal(out[moved], before[moved])


def test_lora_add_rejects_what_it_cannot_read(cpp_kernel):
    x, out, pairs = _layout("one row", torch.float32)
    a, b = _pack(cpp_kernel, pairs[0][0]), _pack(cpp_kernel, pairs[0][1])
    with pytest.raises(RuntimeError, match="four bounds"):
        cpp_kernel.lora_add_(out, x, [a], [b], [0, 1, 0])
    with pytest.raises(RuntimeError, match="rows"):
        cpp_kernel.lora_add_(out, x, [a], [b], [0, 2, 0, 960])
    with pytest.raises(RuntimeError, match="columns"):
        cpp_kernel.lora_add_(out, x, [a], [b], [0, 1, 0, 961])
    with pytest.raises(RuntimeError, match="pack_f32"):
        cpp_kernel.lora_add_(out, x, [pairs[0][0]], [b], [0, 1, 0, 960])
    with pytest.raises(RuntimeError, match="dtype"):
        cpp_kernel.lora_add_(out, x, [_pack(cpp_kernel, pairs[0][0].bfloat16())], [b], [0, 1, 0, 960])
    with pytest.raises(RuntimeError, match="both"):
        cpp_kernel.lora_add_(out.bfloat16(), x, [a], [b], [0, 1, 0, 960])


def _adapter(gen: torch.Generator, modules: dict[str, tuple[str, int, int, int]]) -> LoraAdapter:
    """An adapter of layer 0 with ``modules``: name -> (fused linear, first column, out features, rank)."""
    return LoraAdapter(
        "mem",
        {
            (0, name): LoraModule(
                LoraTarget(linear, start, out_features, 576),
                torch.randn(rank, 576, generator=gen) * 0.1,
                torch.randn(out_features, rank, generator=gen) * 0.1,
                scale=2.0,
            )
            for name, (linear, start, out_features, rank) in modules.items()
        },
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_takes_the_grouped_op_where_the_adapters_are_kernel_panels(cpp_kernel, dtype):
    """Adapters the C++ layer ops packed as panels add through lora_add_ and equal the two-GEMM path; adapters the
    torch layer ops packed (plain tensors) run the two-GEMM path."""
    gen = torch.Generator().manual_seed(3)
    adapters = [
        _adapter(gen, {"self_attn.q_proj": (QKV, 0, 576, 8), "self_attn.v_proj": (QKV, 768, 192, 16)}),
        _adapter(gen, {"self_attn.k_proj": (QKV, 576, 192, 64)}),
        _adapter(gen, {"mlp.up_proj": (GATE_UP, 1536, 1536, 4)}),  # no qkv: not in the call
    ]
    ops = CppLayerOps(pack_weights=True)
    resident = [
        to_device(f"a{i}", a, 1, functools.partial(ops.pack, dense=True), dtype, CPU) for i, a in enumerate(adapters)
    ]
    if not all(adapter.grouped for adapter in resident):
        pytest.skip(f"this CPU's C++ layer ops do not pack {dtype} weights as the kernel's panels")
    segments = [(resident[0], 1, 4), (resident[1], 4, 12), (resident[2], 12, 13), (resident[0], 14, 20)]
    x = torch.randn(20, 576, generator=gen).to(dtype)
    out = torch.randn(20, 960, generator=gen).to(dtype)
    state = LoraStepState(segments, ops.linear)
    assert state.lora_add is not None
    grouped_out = out.clone()
    state.add(0, QKV, x, grouped_out)
    try:
        LoraStepState.grouped_kernel = False
        two_gemm = LoraStepState(segments, ops.linear)
    finally:
        LoraStepState.grouped_kernel = True
    assert two_gemm.lora_add is None
    two_gemm_out = out.clone()
    two_gemm.add(0, QKV, x, two_gemm_out)
    # bf16: the two-GEMM path rounds each delta before adding it, the grouped op adds in fp32 and rounds once.
    scale = two_gemm_out.double().abs().max().item()
    assert (grouped_out.double() - two_gemm_out.double()).abs().max().item() <= 2 * TOLERANCE[dtype] * scale
    for rows in (slice(0, 1), slice(12, 14)):  # base rows and the adapter without qkv
        assert torch.equal(grouped_out[rows], out[rows])
    torch_ops = TorchLayerOps()
    plain = to_device("plain", adapters[0], 1, torch_ops.pack, dtype, CPU)
    assert not plain.grouped and LoraStepState([(plain, 0, 8)], torch_ops.linear).lora_add is None
