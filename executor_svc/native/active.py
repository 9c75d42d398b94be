"""Which kernels an executor runs, read off the objects it chose (not off flags).

Reported by ``Describe`` (``ExecutorInfo.kernels``), the ready log line and
the ``pagoda_executor_kernel_info`` metric:

- ``attention``: the attention backend (cpp, torch, triton);
- ``prefill``: what prompt chunks run (amx-flash, avx512bf16-flash, triton; decode-rows+sdpa where the C++
  backend has no prefill kernel for the model: chunks of up to 512 tokens of context as decode rows, longer
  ones SDPA; sdpa);
- ``gemm``: how linear layers multiply (amx-panel, avx512bf16-panel, avx512-panel, avx2-panel,
  f32-panel-widened, onednn, torch-widened-f32, torch; with
  ``--quantization`` the quantized paths, e.g. amx-int8, joined with ``+`` when the weights run several);
- ``layer_ops``: the norms, rotary and SiLU (cpp, torch);
- ``mlp``: the feed-forward blocks (dense, moe-grouped: experts grouped over the step's tokens, or both);
- ``decode``: how decode-only steps pass the layers (fused-layers: one C++ call for all of them,
  models/fused_decode.py; layer-loop: the model's Python loop);
- ``variant``: the C++ kernel build loaded (native, amx, ..., or none).
"""

from __future__ import annotations

import torch

from executor_svc.attention import cpp_backend
from executor_svc.models.layer_ops import PackedWeight, PanelWeight, WidenedWeight
from executor_svc.native import loader
from executor_svc.quant.quantized_ops import QuantizedLayerOps

KERNEL_KEYS = ("attention", "prefill", "gemm", "layer_ops", "mlp", "decode", "variant")


def active_kernels(runner) -> dict[str, str]:
    """The paths a loaded ModelRunner runs (its backend, its model's layer ops, the loaded kernels)."""
    ops = runner.model.ops
    kernels = loader.loaded()
    return {
        "attention": runner.backend.name,
        "prefill": prefill_path(runner),
        "gemm": gemm_path(ops, runner.dtype, runner.device),
        "layer_ops": ops.name,
        "mlp": runner.model.mlp_path,
        "decode": decode_path(runner),
        "variant": kernels.variant if kernels is not None else "none",
    }


def decode_path(runner) -> str:
    """``fused-layers`` where the model's decode-only steps on this backend run as one C++ call, else
    ``layer-loop``."""
    fused = getattr(runner.model, "fused_decode", None) is not None and runner.backend.name == "cpp"
    return "fused-layers" if fused else "layer-loop"


def gemm_path(ops, dtype: torch.dtype, device: torch.device) -> str:
    """How ``ops`` multiplies by a weight of ``dtype``: what its ``pack`` made of the model's weights (quantized
    layer ops record it), else what it makes of one."""
    if isinstance(ops, QuantizedLayerOps) and ops.gemm_paths:
        return "+".join(ops.gemm_paths)
    packed = ops.pack(torch.zeros(16, 64, dtype=dtype, device=device))  # [out, in]: one panel in every layout
    if isinstance(packed, (PanelWeight, WidenedWeight)):
        return packed.path
    if isinstance(packed, PackedWeight):
        return "onednn"
    return "torch"


def prefill_path(runner) -> str:
    """What the runner's attention backend does with prompt chunks of this model."""
    backend = runner.backend
    if backend.name == "triton":
        return "triton"
    kernel = getattr(backend, "prefill_kernel", None)
    k_cache = runner.kv_cache.layer(0).k
    q = torch.empty(0, 1, runner.config.head_dim, dtype=runner.dtype, device="meta")  # [T, H, Dh]
    if kernel is None:
        return "decode-rows+sdpa" if backend.name == "cpp" else "sdpa"  # cpp_backend.TOKEN_ROWS_MAX_CONTEXT
    if not cpp_backend._prefill_fits(q, k_cache):
        return "sdpa"
    return "amx-flash" if kernel.amx_ready() else "avx512bf16-flash"  # sliding windows and soft-caps included
