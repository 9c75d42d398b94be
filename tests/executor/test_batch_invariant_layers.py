"""The batch-invariant switch of the layer ops and the quantization: which linear paths it picks and refuses.

The kernels' own invariance is test_batch_invariance_kernels.py; here, the
layers a model is built with under ``batch_invariant`` give a row the same
bits at every batch size (1..300), through the same helper.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.models.layer_ops import WIDENED_F32_PANEL, CppLayerOps, PanelWeight, get_layer_ops
from executor_svc.native import loader
from executor_svc.quant import int8
from executor_svc.quant.modes import Target, resolve_quantization
from tests.executor.conftest import native_ops
from tests.executor.test_batch_invariance_kernels import _mismatches, _probes, _weight

CPU = torch.device("cpu")


def _invariant_ops(dtype: torch.dtype) -> CppLayerOps:
    native_ops("f32_panels", "batch-invariant layers need the fp32 panel GEMMs (AVX-512 or AVX2 + FMA)")
    ops = get_layer_ops("auto", CPU, dtype, batch_invariant=True)
    assert isinstance(ops, CppLayerOps) and ops.batch_invariant
    return ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_layer_ops_pack_every_weight_for_a_panel_gemm(dtype):
    ops = _invariant_ops(dtype)
    packed = ops.pack(_weight(576, 192, 1).to(dtype))
    assert isinstance(packed, PanelWeight)
    assert _mismatches(lambda x: ops.linear(x, packed), _probes(576, dtype, 1), 1) == []


def test_bf16_weights_widened_to_fp32_panels_are_invariant_and_rounded_once():
    """The path of CPUs without a bf16 panel kernel (oneDNN would choose its blocking by M there)."""
    ops = _invariant_ops(torch.bfloat16)
    weight, bias = _weight(1536, 576, 2).bfloat16(), torch.randn(576).bfloat16()
    packed = ops._pack_invariant(weight)
    assert packed.path == WIDENED_F32_PANEL and packed.panels.dtype == torch.float32
    probes = _probes(1536, torch.bfloat16, 2)
    assert _mismatches(lambda x: ops.linear(x, packed, bias), probes, 2) == []
    exact = probes.double() @ weight.double().T + bias.double()
    out = ops.linear(probes, packed, bias)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()  # within one bf16 rounding


def test_a_cpu_without_the_panel_gemms_refuses_batch_invariance_and_says_why(cpp_kernel):
    """A build without AVX2 + FMA (the portable x86-64 variant): the kernels load without the panel GEMMs, and no
    weight is packed otherwise."""
    if "f32_panels" in loader.kernels().features:
        pytest.skip("this CPU has the fp32 panel GEMMs: the tests above run them")
    ops = get_layer_ops("auto", CPU, torch.bfloat16, batch_invariant=True)
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.raises(ValueError, match="need the C.. panel GEMMs .an AVX-512 or AVX2 . FMA kernel build."):
            ops.pack(_weight(64, 32, 1).to(dtype))


def test_batch_invariant_refuses_the_torch_layer_ops():
    with pytest.raises(ValueError, match="need the cpp layer ops"):
        get_layer_ops("torch", CPU, torch.bfloat16, batch_invariant=True)


def test_batch_invariant_int8_keeps_int8_activations_at_every_step_and_refuses_torch():
    kernels = loader.kernels()
    if kernels is None or not {"avx512_vnni", "avx2_int8"} & kernels.features:
        pytest.skip("the C++ int8 kernels need AVX512-VNNI, AMX-INT8 or AVX2")
    path, widen_above = Target(CPU, torch.bfloat16, kernels, "auto", batch_invariant=True).int8_path()
    assert path in ("amx-int8", *int8.VECTOR_PATHS) and widen_above == int8.ALWAYS
    weight_only = Target(CPU, torch.bfloat16, kernels, "bf16", batch_invariant=True)
    if path == "amx-int8":  # bf16 activations: widened at every step
        assert weight_only.int8_path() == (path, 0)
    else:  # VNNI and AVX2 have no widened path: the torch code (sgemm) would run it
        with pytest.raises(ValueError, match="batch-invariant int8"):
            weight_only.int8_path()
    for dtype, found in ((torch.float16, kernels), (torch.bfloat16, None)):  # torch-int8: sgemm's blocking
        with pytest.raises(ValueError, match="batch-invariant int8"):
            Target(CPU, dtype, found, "auto", batch_invariant=True).int8_path()


def test_batch_invariant_gguf_blocks_never_switch_activation_kind():
    ops = native_ops("f32_panels", "GGUF block kernels need AVX-512 or AVX2 + FMA")
    kernels = loader.kernels()
    if not {"avx512_vnni", "avx2_int8"} & kernels.features:
        pytest.skip("GGUF block kernels need AVX512-VNNI or AVX2")
    assert Target(CPU, torch.bfloat16, kernels, "auto", batch_invariant=True).block_kernels() == (ops, int8.ALWAYS)
    with pytest.raises(ValueError, match="batch-invariant GGUF"):
        Target(CPU, torch.bfloat16, None, "auto", batch_invariant=True).block_kernels()


@pytest.mark.parametrize("mode", ["int8", "q8_0"])
def test_quantized_layers_of_an_invariant_executor_do_not_depend_on_the_batch(mode, tmp_path):
    kernels = loader.kernels()
    if kernels is None or not {"avx512_vnni", "avx2_int8"} & kernels.features:
        pytest.skip(f"the C++ {mode} kernels need AVX512-VNNI or AVX2")
    base = _invariant_ops(torch.bfloat16)
    quantization = resolve_quantization(mode, "auto", tmp_path, CPU, torch.bfloat16, base, batch_invariant=True)
    ops = quantization.wrap(base)
    layer = ops.pack(_weight(576, 1536, 3).bfloat16())
    assert layer.widen_above == int8.ALWAYS  # the auto mode: 128 rows (int8 on AMX), 16 (GGUF blocks)
    assert _mismatches(lambda x: ops.linear(x, layer), _probes(576, torch.bfloat16, 3), 3) == []
