"""int8 weights (``--quantization int8``): the kernels' GEMMs against a dequantize-then-matmul reference.

Each int8 path (AMX-INT8, AVX512-VNNI, AVX2's vpmaddubsw, the widened bf16
path of large steps, the torch code) is held to a float64 product of the dequantized operands:
the kernel's own quantized activations (an int8 dot product per 64-feature
group is exact, so only the final scaling and rounding differ), or x rounded
to bf16 for the widened path. Rounding as in the bf16 GEMM tests: fp32 within
fp32 sum error, bf16 within one bf16 step of the exact value.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.quant import int8
from tests.executor.conftest import native_ops

ROWS = [1, 5, 8, 17, 48, 64, 128, 129, 2048]
SHAPES = [(16, 64), (100, 40), (960, 576), (576, 1536)]  # (out, in): panel and depth tails, SmolLM2's matmuls


@pytest.fixture(scope="module")
def kernels(cpp_kernel):
    ops = native_ops("f32_panels", "the int8 GEMMs need AVX-512 or AVX2 + FMA")
    if not {"avx512_vnni", "avx2_int8"} & set(ops.cpu_features()):
        pytest.skip("the int8 GEMMs need AVX512-VNNI, AMX-INT8 or AVX2 in the kernel build")
    return ops


def _weights(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    wq, ws = int8.quantize_per_channel(weight)
    return weight, wq, ws


def _reference(x, wq, ws, bias, xq=None, xs=None) -> torch.Tensor:
    """float64 x_dequantized @ (wq * ws).T + bias; x_dequantized from (xq, xs) when given, else x itself."""
    m, k = x.shape
    if xq is None:
        dequantized = x.double()
    else:
        groups = xs.shape[1]
        dequantized = (xq[:m].double().view(m, groups, int8.GROUP) * xs[:m, :, None].double()).flatten(1)[:, :k]
    out = (dequantized @ wq.double().T) * ws.double()
    return out if bias is None else out + bias.double()


def _assert_rounded_once(out: torch.Tensor, exact: torch.Tensor, in_features: int) -> None:
    """fp32: within fp32 sum error; bf16: within one bf16 step of the exact value (plus sum error)."""
    if out.dtype == torch.float32:
        assert (out.double() - exact).abs().max().item() <= 2e-6 * max(1.0, exact.abs().max().item())
    else:
        step = exact.abs().float().clamp_min(1e-3).double() * 2**-7
        assert ((out.double() - exact).abs() <= step + 1e-5 * in_features**0.5).all()


def test_weights_round_to_the_nearest_step_of_their_channel():
    weight = torch.randn(7, 50, generator=torch.Generator().manual_seed(1))
    weight[3] = 0.0
    wq, ws = int8.quantize_per_channel(weight)
    assert wq.dtype == torch.int8 and ws.shape == (7,) and wq.abs().max().item() == 127
    assert ws[3].item() == 1.0 and not wq[3].any()  # an all-zero channel: scale 1, zeros
    assert ((wq.float() * ws[:, None] - weight).abs() <= ws[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
def test_kernel_quantizes_activations_as_the_reference(kernels, dtype, group):
    gen = torch.Generator().manual_seed(group)
    x = (torch.randn(37, 200, generator=gen) * torch.rand(37, 1, generator=gen) * 10).to(dtype)
    x[4] = 0.0
    xq, xs, sums = kernels.quantize_rows_int8(x, group)
    ref_q, ref_s = int8.quantize_activations(x, group)
    assert xq.shape == (48, 256) and xs.shape == (48, 256 // group)  # rows to 16, features to 64
    assert not xq[37:].any() and not xs[37:].any() and not xq[:, 200:].any()
    torch.testing.assert_close(xs[:37], ref_s, rtol=1e-6, atol=0)
    diff = (xq[:37].int() - ref_q.int()).abs()
    assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 1e-3  # a reciprocal's ulp at a tie
    assert torch.equal(sums, xq.int().view(48, -1, group).sum(dim=2))
    assert not xq[4].any() and xs[4].abs().sum().item() == 0


def _paths(kernels) -> list[str]:
    """The C++ paths of this build: its vector path (VNNI, else AVX2), and AMX-INT8 where it runs."""
    paths = ["vnni-int8" if "avx512_vnni" in kernels.cpu_features() else "avx2-int8"]
    if "amx_int8" in kernels.cpu_features() and kernels.amx_int8_ready():
        paths.insert(0, "amx-int8")
    return paths


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_matches_dequantize_then_matmul(kernels, rows, shape, dtype):
    """Every row tile height (4, 8, 12, 16 and several tiles), panel / depth tails, both dtypes, bias or not;
    int8 activations up to 128 rows, the widened bf16 path past them on AMX (VNNI keeps int8)."""
    out_features, in_features = shape
    _, wq, ws = _weights(out_features, in_features, rows * 7 + out_features)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    xq, xs, _ = kernels.quantize_rows_int8(x, int8.GROUP)
    for path in _paths(kernels):
        layer = int8.int8_linear(wq.float() * ws[:, None], path, kernels, int8.WIDEN_ABOVE_ROWS)
        assert torch.equal(layer._wq(), wq)  # quantizing the dequantized weights gives them back
        widened = path == "amx-int8" and rows > int8.WIDEN_ABOVE_ROWS
        for b in (None, bias):
            out = layer(x, b)
            assert out.dtype == dtype and out.shape == (rows, out_features)
            # The widened path multiplies x rounded to bf16; the others the kernel's own int8 activations.
            exact = _reference(x.to(torch.bfloat16), wq, ws, b) if widened else _reference(x, wq, ws, b, xq, xs)
            _assert_rounded_once(out, exact, in_features)


@pytest.mark.parametrize("rows", [1, 8, 48, 2048])
def test_torch_path_computes_the_same_math(kernels, rows):
    """The torch code (no kernels, CUDA, fp16) is the kernels' math in fp32: close to both references."""
    _, wq, ws = _weights(576, 1536, rows)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    for widen_above in (int8.ALWAYS, 0):
        out = int8.int8_matmul(x, wq, ws, None, widen_above)
        if widen_above:
            xq, xs = int8.quantize_activations(x)
            exact = _reference(x, wq, ws, None, xq, xs)
        else:
            exact = _reference(x, wq, ws, None)
        _assert_rounded_once(out, exact, 1536)


def test_activation_modes_pick_the_math(kernels):
    """int8: int8 activations at any size; bf16: weight-only at any size (both paths agree with their reference)."""
    _, wq, ws = _weights(96, 128, 3)
    for rows in (4, 300):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        xq, xs, _ = kernels.quantize_rows_int8(x, int8.GROUP)
        for path in _paths(kernels):
            always_int8 = int8.int8_linear(wq.float() * ws[:, None], path, kernels, int8.ALWAYS)
            _assert_rounded_once(always_int8(x), _reference(x, wq, ws, None, xq, xs), 128)
        if "amx-int8" in _paths(kernels):
            weight_only = int8.int8_linear(wq.float() * ws[:, None], "amx-int8", kernels, 0)
            _assert_rounded_once(weight_only(x), _reference(x, wq, ws, None), 128)


def test_int8_layer_takes_strided_batched_empty_and_fp16_inputs(kernels):
    _, wq, ws = _weights(130, 40, 5)
    for path in [*_paths(kernels), "torch-int8"]:
        layer = int8.int8_linear(wq.float() * ws[:, None], path, kernels, int8.WIDEN_ABOVE_ROWS)
        wide = torch.randn(9, 100, generator=torch.Generator().manual_seed(2))
        x = wide[:, 10:50]  # rows 100 apart
        reference = int8.int8_matmul(x.contiguous(), wq, ws, None, int8.WIDEN_ABOVE_ROWS)
        torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-5)
        assert layer(torch.randn(2, 3, 40)).shape == (2, 3, 130)
        assert layer(torch.zeros(0, 40)).shape == (0, 130)
        half = torch.randn(3, 40).half()  # no kernel takes fp16: the torch code runs
        torch.testing.assert_close(
            layer(half), int8.int8_matmul(half, wq, ws, None, int8.WIDEN_ABOVE_ROWS), rtol=0, atol=0
        )


def test_int8_gemm_rejects_mismatched_inputs(kernels):
    _, wq, ws = _weights(40, 64, 6)
    packed = kernels.pack_int8(wq)
    assert tuple(packed.shape) == (3, 16, 16, 4)
    assert not packed[2, :, 8:].any()  # outputs past N are zero
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear_int8(torch.randn(2, 96), packed, ws, 40, None, True, int8.ALWAYS)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.linear_int8(x, packed, ws, 60, None, True, int8.ALWAYS)
    with pytest.raises(RuntimeError, match="scales"):
        kernels.linear_int8(x, packed, ws[:39], 40, None, True, int8.ALWAYS)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.linear_int8(x, packed, ws, 40, torch.randn(40).bfloat16(), True, int8.ALWAYS)
    if not kernels.amx_int8_ready():
        with pytest.raises(RuntimeError, match="AMX-INT8"):
            kernels.linear_int8(x, packed, ws, 40, None, False, int8.ALWAYS)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.linear_int8(x.half(), packed, ws, 40, None, True, int8.ALWAYS)
    with pytest.raises(RuntimeError, match="pack_int8"):
        kernels.linear_int8(x, packed.float(), ws, 40, None, True, int8.ALWAYS)
    with pytest.raises(RuntimeError, match="int8"):
        kernels.pack_int8(wq.float())


def _fused_paths(kernels) -> list[str]:
    """The int8 paths with the fused gate/up kernel in this build (both need AVX-512-BF16)."""
    if "avx512_bf16" not in kernels.cpu_features():
        return []
    return [path for path in _paths(kernels) if path == "vnni-int8" or "amx" in kernels.cpu_features()]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(64, 40), (3072, 576), (192, 1536)])  # (2I, K): SmolLM2's gate/up included
@pytest.mark.parametrize("widen_above", [int8.WIDEN_ABOVE_ROWS, 0, int8.ALWAYS])
def test_fused_gate_up_is_silu_and_mul_of_the_layer_bit_for_bit(kernels, rows, shape, widen_above):
    """linear_int8_silu = silu_and_mul(linear_int8(x)) exactly: AMX-INT8's decode tiles and widened prefill
    path, and VNNI's blocks (a gate panel with its up panel) at every row count."""
    paths = _fused_paths(kernels)
    if not paths:
        pytest.skip("the fused gate/up kernel needs AVX-512-BF16 with AMX or VNNI")
    out_features, in_features = shape
    _, wq, ws = _weights(out_features, in_features, rows)
    packed = kernels.pack_int8(wq)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    for path in paths:
        vnni = path == "vnni-int8"
        unfused = kernels.silu_and_mul(kernels.linear_int8(x, packed, ws, out_features, None, vnni, widen_above))
        fused = kernels.linear_int8_silu(x, packed, ws, out_features, vnni, widen_above)
        assert fused.shape == (rows, out_features // 2) and fused.dtype == torch.bfloat16
        assert torch.equal(fused, unfused), path
        layer = int8.int8_linear(wq.float() * ws[:, None], path, kernels, widen_above)
        assert layer.fused_silu and torch.equal(layer.silu_and_mul(x.view(1, rows, in_features))[0], unfused)


@pytest.mark.parametrize("vnni", [False, True])
def test_fused_gate_up_refuses_what_it_cannot_run(kernels, vnni):
    """Halves that are not whole 16-output panels, fp32 rows, wrong scales: clear errors; the layer says None."""
    path = "vnni-int8" if vnni else "amx-int8"
    if path not in _fused_paths(kernels):
        pytest.skip(f"this build has no fused gate/up kernel for {path}")
    _, wq, ws = _weights(48, 64, 7)  # three panels: no whole halves
    packed = kernels.pack_int8(wq)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="halves"):
        kernels.linear_int8_silu(x, packed, ws, 48, vnni, int8.WIDEN_ABOVE_ROWS)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.linear_int8_silu(x.float(), packed, ws, 48, vnni, int8.WIDEN_ABOVE_ROWS)
    _, wq, ws = _weights(64, 64, 8)
    with pytest.raises(RuntimeError, match="scales"):
        kernels.linear_int8_silu(x, kernels.pack_int8(wq), ws[:32], 64, vnni, int8.WIDEN_ABOVE_ROWS)
    if not kernels.amx_int8_ready():
        with pytest.raises(RuntimeError, match="AMX-INT8"):
            kernels.linear_int8_silu(x, kernels.pack_int8(wq), ws, 64, False, int8.WIDEN_ABOVE_ROWS)
    assert not int8.int8_linear(torch.randn(48, 64), path, kernels, int8.WIDEN_ABOVE_ROWS).fused_silu
    layer = int8.int8_linear(torch.randn(64, 64), path, kernels, int8.WIDEN_ABOVE_ROWS)
    assert layer.silu_and_mul(x.float()) is None  # fp32 rows: the caller runs the layer and silu_and_mul
