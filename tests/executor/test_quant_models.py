"""Quantized models end to end on the tiny checkpoints: every family's linear layers through the int8 paths.

The C++ int8 kernels and the torch code compute the same math, so a model
served on either gives the same logits (within fp32 sum order) and the same
greedy tokens; against the dense model, int8 moves the logits by the
quantization error only. MoE routers stay dense. Bad flags fail at start,
before any weight is read.
"""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from executor_svc.models.layer_ops import CppLayerOps, TorchLayerOps
from executor_svc.models.moe import MoeBlock
from executor_svc.native.active import active_kernels
from executor_svc.quant import int8
from executor_svc.quant.base import QuantizedLinear
from executor_svc.quant.modes import resolve_quantization
from executor_svc.runner.model_runner import ModelRunner
from tests.executor.conftest import install_recorder
from tests.executor.test_model_hf_parity import _generate, greedy_prompts

BLOCK_SIZE = 4
FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "phi3", "mixtral", "olmoe"]


def _runner(folder, **kwargs) -> ModelRunner:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, kv_cache_memory_bytes=2**21)
    return ModelRunner(str(folder), **{**options, **kwargs})


def _logits(runner: ModelRunner, num_new: int = 6) -> dict[tuple[int, ...], torch.Tensor]:
    """The logits of every sampled position of the greedy prompts, by the tokens before it."""
    recorder = install_recorder(runner)
    _generate(runner, greedy_prompts(), num_new, chunk=5)
    return {tuple(token_ids): logits for token_ids, logits in recorder.records}


@pytest.mark.parametrize("arch", FAMILIES)
def test_int8_kernels_compute_every_layer_as_the_torch_code(arch, checkpoints, cpp_kernel):
    """Every int8 matmul of a real run (prefill chunks, decodes, each family's shapes) against the torch code on
    the same input. (Whole runs are not compared: a last-bit difference upstream may move one activation across
    a rounding boundary, which is within the quantization's error but then spreads.)"""
    runner = _runner(checkpoints[arch], quantization="int8")
    assert "int8" in active_kernels(runner)["gemm"]
    calls = []
    linear = runner.model.ops.linear

    def recording(x, weight, bias=None):
        y = linear(x, weight, bias)
        if isinstance(weight, QuantizedLinear):
            calls.append((x.clone(), weight, bias, y.clone()))  # y is rotated in place later
        return y

    runner.model.ops.linear = recording
    for layer in runner.model.layers:  # blocks that bound ops.linear at load
        if hasattr(layer.mlp, "linear"):
            layer.mlp.linear = recording
    _generate(runner, greedy_prompts(), 4, chunk=5)
    assert len(calls) > 4 * runner.config.num_layers
    for x, weight, bias, y in calls:
        flat = x.reshape(-1, x.shape[-1])
        expected = int8.int8_matmul(flat, weight._wq(), weight.scales, bias, weight.widen_above)
        torch.testing.assert_close(y.reshape(expected.shape), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_stays_close_to_the_dense_model(arch, dtype, checkpoints, cpp_kernel):
    dense = _logits(_runner(checkpoints[arch], dtype=dtype))
    quantized = _logits(_runner(checkpoints[arch], dtype=dtype, quantization="int8"))
    shared = dense.keys() & quantized.keys()  # greedy tokens may part after a near tie
    assert len(shared) >= len(greedy_prompts()) * 2
    cosines = sorted(
        torch.nn.functional.cosine_similarity(quantized[t].float(), dense[t].float(), dim=0).item() for t in shared
    )
    # A MoE router's near tie may pick another expert for one token, and its logits part (the tiny Mixtral in
    # bf16: router logits 0.4434 against 0.4414 for its second and third expert, flipped by the last bits of
    # the attention path): one such position may fall to 0.9, every other stays as close as a dense model's.
    flips = 1 if arch == "mixtral" else 0
    assert all(c > 0.995 for c in cosines[flips:]) and cosines[0] > 0.9, cosines[:3]


def test_every_linear_weight_is_quantized_but_the_routers(checkpoints, cpp_kernel):
    runner = _runner(checkpoints["mixtral"], quantization="int8")
    model = runner.model
    assert isinstance(model.lm_head, QuantizedLinear)
    for layer in model.layers:
        assert isinstance(layer.attn.qkv, QuantizedLinear) and isinstance(layer.attn.o_proj, QuantizedLinear)
        assert isinstance(layer.mlp, MoeBlock) and not isinstance(layer.mlp.router, QuantizedLinear)
        assert all(isinstance(w, QuantizedLinear) for expert in layer.mlp.experts for w in expert)
    assert model.embed.dtype == torch.float32  # the embedding table stays in the model dtype
    assert runner.info.quantization == "int8"
    assert _runner(checkpoints["mixtral"]).info.quantization == "none"


def test_int8_layers_take_a_quarter_of_the_fp32_bytes(checkpoints, cpp_kernel):
    runner = _runner(checkpoints["llama"], quantization="int8")
    layers = [runner.model.lm_head, *(w for layer in runner.model.layers for w in (layer.attn.qkv, layer.attn.o_proj))]
    for layer in layers:
        in_features = -(-layer.in_features // 64) * 64
        dense = layer.out_features * in_features * 4
        assert layer.nbytes <= dense / 4 * 1.2  # the scales (and VNNI's column sums) on top


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(quantization="int4"), r"unknown --quantization 'int4'; use one of auto, none, int8"),
        (dict(quantization="int8", quantized_activations="fp8"), r"unknown --quantized-activations 'fp8'"),
    ],
)
def test_bad_flags_fail_before_the_weights_are_read(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        ModelRunner(str(tmp_path / "no-such-model"), device="cpu", **flags)


@pytest.mark.parametrize("mode", ["int8", "q8_0"])
def test_quantized_layers_on_the_torch_code_are_said_to_be_slower(tmp_path, mode):
    """The torch layer ops (no C++ quantized kernels) dequantize every call: the load says so once."""
    cpu = torch.device("cpu")
    with capture_logs() as logs:
        resolve_quantization(mode, "auto", tmp_path / "model", cpu, torch.bfloat16, TorchLayerOps())
    warned = [e for e in logs if e["event"] == "quantized_layers_on_torch_code"]
    assert len(warned) == 1 and warned[0]["quantization"] == mode and warned[0]["log_level"] == "warning"
    with capture_logs() as logs:
        resolve_quantization("none", "auto", tmp_path / "model", cpu, torch.bfloat16, TorchLayerOps())
    assert not [e for e in logs if e["event"] == "quantized_layers_on_torch_code"]


def test_quantized_layers_on_the_int8_kernels_are_not_warned_about(tmp_path, cpp_kernel):
    from executor_svc.native import loader

    if not {"avx512_vnni", "amx_int8", "avx2_int8"} & loader.kernels().features:
        pytest.skip("no C++ int8 kernels on this CPU: the test above covers the warning")
    with capture_logs() as logs:
        resolve_quantization("int8", "auto", tmp_path / "model", torch.device("cpu"), torch.bfloat16, CppLayerOps())
    assert not [e for e in logs if e["event"] == "quantized_layers_on_torch_code"]
