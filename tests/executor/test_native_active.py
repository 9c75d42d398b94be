"""The kernel paths an executor reports are those of the objects it runs (runners on tiny checkpoints)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from prometheus_client import generate_latest

from executor_svc.models.layer_ops import (
    WIDENED_F32_PANEL,
    CppLayerOps,
    TorchLayerOps,
    f32_panel_path,
    onednn_bf16_packs,
)
from executor_svc.native import active, loader
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.serving.metrics import ExecutorMetrics
from tests.executor.conftest import make_tiny_checkpoint


def _runner(folder, dtype: str, attention: str = "auto") -> ModelRunner:
    return ModelRunner(
        str(folder), dtype=dtype, device="cpu", kv_cache_memory_bytes=1 << 20, attention_backend=attention
    )


def test_gemm_path_is_what_pack_makes_of_a_weight(cpp_kernel):
    cpu = torch.device("cpu")
    kernels = loader.kernels()
    assert active.gemm_path(TorchLayerOps(), torch.float32, cpu) == "torch"
    assert active.gemm_path(CppLayerOps(pack_weights=False), torch.bfloat16, cpu) == "torch"
    packing = CppLayerOps(pack_weights=True)
    panels = "f32_panels" in kernels.features
    assert active.gemm_path(packing, torch.float32, cpu) == (f32_panel_path() if panels else "torch")
    widened = WIDENED_F32_PANEL if panels else "torch-widened-f32"  # no bf16 packing: fp32 copies
    bf16 = "onednn" if onednn_bf16_packs() else widened
    if packing.gemm is not None and packing.gemm.bf16_kernels_ready():
        bf16 = "amx-panel" if packing.gemm.amx_ready() else "avx512bf16-panel"
    assert active.gemm_path(packing, torch.bfloat16, cpu) == bf16
    assert active.gemm_path(packing, torch.float16, cpu) == "torch"


def test_fp32_runner_reports_its_backend_layer_ops_and_variant(checkpoints, cpp_kernel):
    kernels = active.active_kernels(_runner(checkpoints["llama"], "float32"))
    assert kernels == {
        "attention": "cpp",
        "prefill": "decode-rows+sdpa",  # no fp32 prefill kernel: short chunks as decode rows, long ones SDPA
        "gemm": f32_panel_path() if "f32_panels" in loader.kernels().features else "torch",
        "layer_ops": "cpp",
        "mlp": "dense",
        "decode": "fused-layers" if "f32_panels" in loader.kernels().features else "layer-loop",  # fp32 panels
        "variant": loader.kernels().variant,
    }
    assert tuple(kernels) == active.KERNEL_KEYS
    on_torch = active.active_kernels(_runner(checkpoints["llama"], "float32", "torch"))
    assert on_torch["attention"] == "torch" and on_torch["decode"] == "layer-loop" and on_torch["prefill"] == "sdpa"


@pytest.mark.parametrize(("arch", "mlp"), [("mixtral", "moe-grouped"), ("qwen3_moe", "moe-grouped+dense")])
def test_moe_runner_reports_its_feed_forward_path(checkpoints, arch, mlp):
    """Experts grouped over the step's tokens; Qwen3-MoE's dense layer (mlp_only_layers) shows too."""
    assert active.active_kernels(_runner(checkpoints[arch], "float32"))["mlp"] == mlp


@pytest.mark.parametrize(
    "arch,head_dim", [("llama", 64), ("mistral_window", 64), ("llama", 16), ("llama", 256), ("llama", 24)]
)
def test_bf16_prefill_is_our_kernel_only_where_it_takes_the_model(tmp_path, cpp_kernel, arch, head_dim):
    """The prefill kernel: bf16, head_dim 64, 128 or 256 (sliding windows and soft-caps included), on a CPU
    that grants AMX (amx-flash) or has AVX512-BF16 (avx512bf16-flash)."""
    folder = make_tiny_checkpoint(tmp_path, arch, head_dim=head_dim, hidden_size=4 * head_dim)
    expected = "decode-rows+sdpa"  # no prefill kernel in this build or on this CPU
    if cpp_kernel.bf16_kernels_ready():
        expected = "sdpa"  # the kernel, but not for this head_dim
        if head_dim in (64, 128, 256):
            expected = "amx-flash" if cpp_kernel.amx_ready() else "avx512bf16-flash"
    assert active.prefill_path(_runner(folder, "bfloat16")) == expected


def test_kernel_info_metric_carries_the_paths():
    metrics = ExecutorMetrics()
    paths = {"attention": "cpp", "prefill": "sdpa", "gemm": "onednn", "layer_ops": "cpp", "variant": "avx512"}
    metrics.set_kernels(paths)
    text = generate_latest(metrics.registry).decode()
    labels = ",".join(f'{key}="{value}"' for key, value in sorted(paths.items()))
    assert f"pagoda_executor_kernel_info{{{labels}}} 1.0" in text


def test_serving_never_imports_the_jit_extension_builder(checkpoints, cpp_kernel):
    """A runner on the C++ paths, built in a fresh process, leaves torch.utils.cpp_extension unimported."""
    script = f"""
import sys
import executor_svc.main
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.native.active import active_kernels
runner = ModelRunner({str(checkpoints["llama"])!r}, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20)
assert active_kernels(runner)["layer_ops"] == "cpp", active_kernels(runner)
print("cpp_extension imported:", "torch.utils.cpp_extension" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cpp_extension imported: False" in done.stdout
