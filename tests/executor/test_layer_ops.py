"""The fused C++ layer ops against the Hugging Face modules they replace."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from executor_svc.models.layer_ops import CppLayerOps, TorchLayerOps, get_layer_ops
from tests.executor.conftest import native_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# bf16 is rounded at the same points as the HF code, so it matches bit for bit;
# fp32/fp16 differ only by the order of a sum.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.0, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def ops(cpp_kernel) -> CppLayerOps:
    return CppLayerOps()


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert (actual.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * max(
        1.0, expected.abs().max().item()
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [96, 100])  # vector lanes only; a width the scalar loop runs
def test_rms_norm_matches_llama_rmsnorm(ops, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.rand(hidden, generator=gen) + 0.5
    norm = norm.to(dtype)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    _close(ops.rms_norm(x, norm.weight.data, 1e-5), norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_then_normalizes(ops, dtype):
    gen = torch.Generator().manual_seed(3)
    norm = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data = (torch.rand(64, generator=gen) + 0.5).to(dtype)
    x, residual = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    expected_residual = residual + x  # the HF decoder layer's residual add, rounded in dtype
    out = ops.add_rms_norm(x, residual, norm.weight.data, 1e-6)
    assert torch.equal(residual, expected_residual)
    _close(out, norm(expected_residual), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_mlp_activation(ops, dtype):
    gate_up = (torch.randn(9, 2 * 80, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40])  # halves of 16 (vector lanes only) and of 20 (a scalar tail)
def test_rotary_in_place_matches_apply_rotary_pos_emb(ops, dtype, head_dim):
    gen = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, max_len = 6, 4, 2, 50
    freqs = torch.outer(torch.arange(max_len).float(), torch.rand(head_dim // 2, generator=gen))
    cos_table, sin_table = freqs.cos().to(dtype), freqs.sin().to(dtype)
    positions = torch.tensor([0, 3, 49, 7, 7, 12])
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    untouched_v = qkv[:, heads + kv_heads :].clone()
    q, k = qkv[:, :heads].clone(), qkv[:, heads : heads + kv_heads].clone()
    cos = torch.cat((cos_table[positions], cos_table[positions]), dim=-1)  # HF's full-width [T, D]
    sin = torch.cat((sin_table[positions], sin_table[positions]), dim=-1)
    # HF layout [B, N, T, D]; unsqueeze_dim=1 broadcasts cos [B, T, D] over heads.
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    qk = qkv[:, : heads + kv_heads]
    assert ops.rotate(qk, (positions, cos_table, sin_table)) is qk
    _close(qkv[:, :heads], q_ref[0].transpose(0, 1), dtype)
    _close(qkv[:, heads : heads + kv_heads], k_ref[0].transpose(0, 1), dtype)
    assert torch.equal(qkv[:, heads + kv_heads :], untouched_v)


def test_torch_ops_agree_with_cpp_ops(ops):
    gen = torch.Generator().manual_seed(6)
    x, residual = (torch.randn(4, 48, generator=gen) for _ in range(2))
    weight = torch.rand(48, generator=gen) + 0.5
    torch_residual = residual.clone()
    _close(
        ops.add_rms_norm(x, residual, weight, 1e-5),
        TorchLayerOps().add_rms_norm(x, torch_residual, weight, 1e-5),
        torch.float32,
    )
    _close(residual, torch_residual, torch.float32)


def test_bad_inputs_are_refused(ops):
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match=r"\[N, H\]"):
        ops.rms_norm(torch.ones(2, 8).t(), weight[:2], 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), weight, 1e-6)
    with pytest.raises(RuntimeError, match="2I"):
        ops.silu_and_mul(torch.ones(2, 7))
    table = torch.ones(4, 4)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rotate(torch.ones(1, 2, 8), (torch.tensor([4]), table, table))


def test_layer_ops_picks_torch_off_the_cpu_or_unbuilt(monkeypatch):
    from executor_svc.native import loader

    assert get_layer_ops("auto", torch.device("meta")).name == "torch"
    monkeypatch.setattr(loader, "kernels", lambda: None)
    assert get_layer_ops("auto", torch.device("cpu")).name == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 1000])
def test_argmax_matches_torch_first_max_and_nan(ops, vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=gen) * 5).to(torch.bfloat16).to(dtype)  # bf16 values make ties likely
    logits[1] = logits[1].round()  # many exact ties: the first index wins
    logits[2] = float("-inf")
    if vocab > 3:
        logits[3, vocab // 2] = float("nan")
        logits[3, vocab - 1] = float("nan")  # the first NaN is the answer
        logits[4, vocab - 1] = float("inf")
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    strided = torch.randn(4, 2 * vocab, generator=gen).to(dtype)[:, :vocab]  # rows not adjacent
    assert torch.equal(ops.argmax(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 5, 48, 200])
def test_packed_bf16_linear_equals_f_linear(cpp_kernel, rows):
    from executor_svc.models.layer_ops import (
        WIDENED_F32_PANEL,
        PackedWeight,
        PanelWeight,
        WidenedWeight,
        onednn_bf16_packs,
    )

    ops = CppLayerOps(pack_weights=True)
    if not ops.pack_weights:
        pytest.skip("this torch build has no oneDNN linear packing")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    packed = ops.pack(weight)
    # Our panels (AMX or AVX512-BF16), else oneDNN's layout, else (AVX2 alone) fp32: our fp32 panels where they
    # run, else a copy for torch's sgemm. Widened: the fp32 product of the same values, rounded to bf16 once.
    exact = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    if ops.gemm is not None and ops.gemm.bf16_kernels_ready():
        assert isinstance(packed, PanelWeight)
    elif onednn_bf16_packs():
        assert isinstance(packed, PackedWeight)
    elif ops.gemm is not None:
        assert isinstance(packed, PanelWeight) and packed.path == WIDENED_F32_PANEL
        fp32 = ops.gemm.linear_f32(x.float(), ops.gemm.pack_f32(weight.float()), 96, bias.float())
        assert torch.equal(ops.linear(x, packed, bias), fp32.bfloat16())
        assert (fp32 - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
    else:
        assert isinstance(packed, WidenedWeight) and torch.equal(packed.weight, weight.float())
        assert torch.equal(ops.linear(x, packed, bias), exact.bfloat16())
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    for b in (None, bias):
        out = ops.linear(x, packed, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
        reference = expected if b is not None else expected - bias.float()
        assert (out.float() - reference).abs().max().item() <= 0.02 * reference.abs().max().item()
    assert ops.pack(weight.float()) is not None and not isinstance(ops.pack(weight.float()), PackedWeight)


@pytest.fixture(scope="module")
def gemm(cpp_kernel):
    return native_ops("f32_panels", "the fp32 panel GEMM needs AVX-512 or AVX2 + FMA")


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 48, 97, 300])
@pytest.mark.parametrize("out_features", [64, 100, 960])
def test_fp32_panel_linear_matches_float64(gemm, rows, out_features):
    """Every row tile (1-6 rows) and panel tail (N not a multiple of 64), with and without bias."""
    from executor_svc.models.layer_ops import PanelWeight

    ops = CppLayerOps(pack_weights=True)
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, 72, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, 72, generator=gen)
    packed = ops.pack(weight)
    assert isinstance(packed, PanelWeight)
    for b in (None, bias):
        out = ops.linear(x, packed, b)
        expected = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert out.dtype == torch.float32 and out.shape == (rows, out_features)
        assert (out.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_fp32_panel_linear_takes_strided_and_batched_inputs(gemm):
    ops = CppLayerOps(pack_weights=True)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(130, 40, generator=gen)
    packed = ops.pack(weight)
    wide = torch.randn(9, 100, generator=gen)
    x = wide[:, 10:50]  # rows 100 apart
    torch.testing.assert_close(ops.linear(x, packed), x @ weight.T, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 40, generator=gen)
    assert ops.linear(x3, packed).shape == (2, 3, 130)
    torch.testing.assert_close(ops.linear(x3, packed), x3 @ weight.T, rtol=1e-5, atol=1e-5)
    assert ops.linear(torch.zeros(0, 40), packed).shape == (0, 130)


def test_fp32_panel_linear_rejects_mismatched_inputs(gemm):
    weight = torch.randn(70, 32)
    panels = gemm.pack_f32(weight)
    assert tuple(panels.shape) == (2, 32, 64)
    assert torch.equal(panels[1, :, 6:], torch.zeros(32, 58))  # the tail panel is zero-padded
    with pytest.raises(RuntimeError, match="features"):
        gemm.linear_f32(torch.randn(3, 31), panels, 70, None)
    with pytest.raises(RuntimeError, match="out_features"):
        gemm.linear_f32(torch.randn(3, 32), panels, 200, None)
    with pytest.raises(RuntimeError, match="bias"):
        gemm.linear_f32(torch.randn(3, 32), panels, 70, torch.randn(69))
    with pytest.raises(RuntimeError, match="float32"):
        gemm.linear_f32(torch.randn(3, 32).bfloat16(), panels, 70, None)
    with pytest.raises(RuntimeError, match="float32"):
        gemm.pack_f32(weight.bfloat16())


@pytest.fixture(scope="module")
def amx(gemm):
    """The bf16 panel GEMM: AMX tiles, or AVX512-BF16 dot products on CPUs without AMX."""
    if not gemm.bf16_kernels_ready():
        pytest.skip("needs AMX (and a kernel that grants it) or AVX512-BF16")
    return gemm


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 48, 64, 65, 100, 300])
@pytest.mark.parametrize("shape", [(16, 64), (100, 40), (960, 576)])
def test_bf16_panel_linear_rounds_the_fp32_product_once(amx, rows, shape):
    """Decode (<= 64 rows) and prefill blocking, row / panel / depth tails: each
    output is the fp32 sum of bf16 products rounded once, so it is within one
    bf16 step of the exactly rounded product and equals oneDNN almost always."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    panels = amx.pack_bf16(weight)
    for b in (None, bias):
        out = amx.linear_bf16(x, panels, out_features, b)
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        step = exact.abs().float().clamp_min(1e-3) * 2**-7  # one bf16 ulp at the value
        assert ((out.double() - exact).abs() <= step.double() + 1e-4 * in_features**0.5).all()
        reference = torch.nn.functional.linear(x, weight, b)
        assert (out != reference).float().mean().item() < 0.01


def test_bf16_panel_linear_takes_strided_rows_and_rejects_mismatches(amx):
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    panels = amx.pack_bf16(weight)
    assert tuple(panels.shape) == (3, 32, 16, 2)
    wide = torch.randn(7, 100, generator=gen).to(torch.bfloat16)
    x = wide[:, 20:84]
    expected = torch.nn.functional.linear(x.float(), weight.float())
    assert (
        amx.linear_bf16(x, panels, 40, None).float() - expected
    ).abs().max().item() <= 0.02 * expected.abs().max().item()
    assert amx.linear_bf16(torch.zeros(0, 64, dtype=torch.bfloat16), panels, 40, None).shape == (0, 40)
    with pytest.raises(RuntimeError, match="features"):
        amx.linear_bf16(torch.randn(2, 96).bfloat16(), panels, 40, None)
    with pytest.raises(RuntimeError, match="out_features"):
        amx.linear_bf16(torch.randn(2, 64).bfloat16(), panels, 60, None)
    with pytest.raises(RuntimeError, match="bias"):
        amx.linear_bf16(torch.randn(2, 64).bfloat16(), panels, 40, torch.randn(40))
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx.linear_bf16(torch.randn(2, 64), panels, 40, None)
