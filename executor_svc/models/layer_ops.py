"""The decoder's linear layers and elementwise ops behind one contract (``LayerOps``), by name.

``torch``: plain torch, any device. ``cpp``: our fused C++ kernels on the CPU
(executor_svc/native/cpu_ops.cpp, and cpu_gemm.cpp for the linear layers),
with the torch ops for what they do not cover. ``auto`` takes the C++ ops on a
CPU where they are already built, else torch; the model code does not branch.
A new implementation is one class plus one ``LAYER_OPS.register`` entry.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Protocol

import structlog
import torch
import torch.nn.functional as F

from executor_svc.attention.implementations import Implementation, ImplementationRegistry
from executor_svc.models.rope import RotaryEmbedding, apply_rotary
from executor_svc.native import loader

log = structlog.get_logger(__name__)


class LayerOps(Protocol):
    """What a decoder layer computes with; weights go through ``pack`` once, at load."""

    name: str

    def pack(self, weight: torch.Tensor, dense: bool = False) -> Any:
        """A weight [out, in] in the form ``linear`` takes (maybe opaque).

        ``dense``: never quantize it (MoE routers), whatever ``--quantization`` says; layer ops that do not
        quantize (these two) ignore it.
        """
        ...

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, in] @ weight.T (+ bias) -> [N, out]."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of x [N, H]."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x in place; returns RMSNorm(residual)."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
        ...

    def rotary_for(self, rope: RotaryEmbedding, rope_rows: torch.Tensor) -> Any:
        """Per-step rotary state for ``rotate`` (looked up once, used by every layer) of the tokens' table rows."""
        ...

    def rotate(self, x: torch.Tensor, rotary: Any) -> torch.Tensor:
        """x [T, N, Dh] rotated (a new tensor or x itself)."""
        ...

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax [B, V] -> [B] int64 (first index of the max; NaN counts as max)."""
        ...


class TorchLayerOps:
    """Reference implementations in torch (any device)."""

    name = "torch"

    def pack(self, weight: torch.Tensor, dense: bool = False):
        """A weight [out, in] in the form ``linear`` takes (here: as is)."""
        return weight

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, in] @ weight.T (+ bias) -> [N, out]."""
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of x [N, H]."""
        return F.rms_norm(x, x.shape[-1:], weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x in place; returns RMSNorm(residual)."""
        residual.add_(x)
        return F.rms_norm(residual, residual.shape[-1:], weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_for(self, rope: RotaryEmbedding, rope_rows: torch.Tensor):
        """Per-step rotary state for ``rotate`` (looked up once, used by every layer) of the tokens' table rows."""
        return rope.lookup(rope_rows)

    def rotate(self, x: torch.Tensor, rotary) -> torch.Tensor:
        """x [T, N, Dh] rotated (a new tensor or x itself)."""
        cos, sin = rotary
        return apply_rotary(x, cos, sin)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax [B, V] -> [B] int64 (first index of the max; NaN counts as max)."""
        return logits.argmax(dim=-1)


class CppLayerOps:
    """The fused C++ CPU kernels; rotates in place. Delegates to the torch ops where they do not apply."""

    name = "cpp"

    def __init__(self, pack_weights: bool | None = None, batch_invariant: bool = False):
        """``batch_invariant``: every linear layer runs a kernel whose output rows do not depend on the other
        rows of the call (our panel GEMMs), never oneDNN or sgemm, which choose their blocking by M."""
        self.kernel, gemm = load_kernels()
        self.torch_ops = TorchLayerOps()  # unpacked linear layers, argmax of other dtypes or layouts
        self.batch_invariant = batch_invariant
        self.pack_weights = batch_invariant or (_can_pack() if pack_weights is None else pack_weights)
        self.gemm = gemm if self.pack_weights else None
        self.f32_panel_path = f32_panel_path()

    def pack(self, weight, dense=False):
        """Weights reordered once for the matmul that reads them.

        bf16: panels for our kernel (native/cpu_gemm.cpp) where the CPU
        has AMX or AVX512-BF16: it streams the weights at memory speed for
        decode batches (AMX: 1.3-1.8x oneDNN's speed at 8-24 rows in a
        SmolLM2 step, within ~20% of oneDNN for prefill; AVX512-BF16 dot
        products on AMD Zen 4: 1.9x at 1 row, 1.4x at 8, even at 2,048).
        Else oneDNN's blocked layout: an unpacked weight is reordered again
        inside every matmul call, which costs more than the product itself
        at decode batch sizes. Either way bf16 inputs, fp32 accumulation,
        one rounding. On a CPU oneDNN refuses bf16 packing on (AVX2 alone,
        e.g. AMD Zen 3) torch's bf16 linear runs at 4-6 GFLOP/s a core, a
        seventh of its sgemm: the weight is widened to fp32 once (twice the
        memory) and multiplied by our fp32 panels where they run, else by
        sgemm, the sums rounded to bf16 once.

        fp32: column panels for our kernel (native/cpu_gemm.cpp), which
        streams the weights at memory speed for decode batches (MKL's sgemm
        reads them at half of it there) and matches sgemm for prefill. On
        AVX2 + FMA alone (AMD Zen 3) the same sums run 8 wide: 1.5-3.8x
        sgemm at 1-16 rows, 1.0-2x at 32-64, 0.93-1.03x at 2,048.
        """
        if not self.pack_weights:
            return weight
        if weight.dtype == torch.bfloat16 and self.gemm is not None and self.gemm.bf16_kernels_ready():
            path = "amx-panel" if self.gemm.amx_ready() else "avx512bf16-panel"
            return PanelWeight(self.gemm.pack_bf16(weight), weight.shape[0], path)
        if self.batch_invariant:
            return self._pack_invariant(weight)
        if weight.dtype == torch.bfloat16 and onednn_bf16_packs():
            return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight, None), weight.shape[0])
        if weight.dtype == torch.bfloat16 and weight.dim() == 2:
            if self.gemm is not None:
                return PanelWeight(self.gemm.pack_f32(weight.float()), weight.shape[0], WIDENED_F32_PANEL)
            return WidenedWeight(weight.float(), weight.shape[0])
        if weight.dtype == torch.float32 and self.gemm is not None and weight.dim() == 2:
            return PanelWeight(self.gemm.pack_f32(weight), weight.shape[0], self.f32_panel_path)
        return weight

    def _pack_invariant(self, weight: torch.Tensor) -> PanelWeight:
        """A weight for the fp32 panels when no bf16 panel kernel runs here: bf16 weights widened (exactly),
        multiplied in fp32 and rounded once, as the bf16 kernels round (twice the bytes a step reads).

        Raises:
            ValueError: this build has no fp32 panel GEMM (AVX-512 or AVX2 + FMA), or the weight is neither bf16
                nor fp32.
        """
        if self.gemm is None or weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2:
            raise ValueError(
                "batch-invariant linear layers need the C++ panel GEMMs (an AVX-512 or AVX2 + FMA kernel build) and "
                "bf16 or fp32 "
                f"weights; got {weight.dtype} weights and {'no' if self.gemm is None else 'a'} panel GEMM"
            )
        path = self.f32_panel_path if weight.dtype == torch.float32 else WIDENED_F32_PANEL
        return PanelWeight(self.gemm.pack_f32(weight.float()), weight.shape[0], path)

    def linear(self, x, weight, bias=None):
        if isinstance(weight, PackedWeight):
            return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
        if isinstance(weight, WidenedWeight):  # bf16 inputs widened exactly, fp32 sums rounded to bf16 once
            b = None if bias is None else bias.float()
            return F.linear(x.float(), weight.weight, b).to(x.dtype)
        if isinstance(weight, PanelWeight):
            flat = x.reshape(-1, x.shape[-1])
            shape = (*x.shape[:-1], weight.out_features)
            if weight.path == WIDENED_F32_PANEL:  # bf16 rows widened, fp32 sums rounded to bf16 once
                b = None if bias is None else bias.float()
                return self.gemm.linear_f32(flat.float(), weight.panels, weight.out_features, b).to(x.dtype).view(shape)
            gemm = self.gemm.linear_f32 if weight.panels.dtype == torch.float32 else self.gemm.linear_bf16
            return gemm(flat, weight.panels, weight.out_features, bias).view(shape)
        return self.torch_ops.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps):
        return self.kernel.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernel.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up):
        return self.kernel.silu_and_mul(gate_up)

    def rotary_for(self, rope, rope_rows):
        return rope_rows, rope.cos, rope.sin  # the kernel indexes the tables by row

    def rotate(self, x, rotary):
        self.kernel.rotary_(x, *rotary)
        return x

    def argmax(self, logits):
        if (
            logits.dtype in (torch.bfloat16, torch.float32)
            and logits.dim() == 2
            and logits.stride(-1) == 1
            and logits.shape[1]
        ):
            return self.kernel.argmax_rows(logits)
        return self.torch_ops.argmax(logits)


class PackedWeight:
    """A linear weight in oneDNN's blocked layout (opaque; only ``linear`` reads it)."""

    def __init__(self, packed: torch.Tensor, out_features: int):
        self.packed = packed
        self.out_features = out_features


class WidenedWeight:
    """A bf16 linear weight held in fp32 for torch's sgemm, where neither our panels nor oneDNN's packed bf16
    run (AVX2 alone); ``path`` names it in the executor's kernel report."""

    path = "torch-widened-f32"

    def __init__(self, weight: torch.Tensor, out_features: int):
        self.weight = weight  # [out, in] fp32, the bf16 values exactly
        self.out_features = out_features


# The path of a bf16 weight held as fp32 panels (CPUs without bf16 panels: batch-invariant layer ops, and every
# CPU where oneDNN does not pack bf16 either, e.g. AVX2 alone).
WIDENED_F32_PANEL = "f32-panel-widened"


class PanelWeight:
    """A linear weight as column panels for native/cpu_gemm.cpp, fp32 or bf16 (only ``linear`` reads it).

    ``path`` names the kernel that multiplies it: ``avx512-panel`` or ``avx2-panel`` (fp32; the same bits),
    ``amx-panel`` (bf16 on AMX tiles), ``avx512bf16-panel`` (bf16 on AVX512-BF16 dot products, CPUs without AMX)
    or ``f32-panel-widened`` (a bf16 weight as fp32 panels, for bf16 rows: where no bf16 panel kernel runs and
    either batch-invariant layer ops or a CPU without oneDNN's bf16 packing ask for it).
    """

    def __init__(self, panels: torch.Tensor, out_features: int, path: str):
        self.panels = panels
        self.out_features = out_features
        self.path = path


def load_kernels() -> tuple[Any, Any | None]:
    """The installed kernels' ops, twice: as fused ops, and as the panel GEMM when the loaded variant has its
    fp32 kernel, AVX-512 or AVX2 + FMA (else None: sgemm / oneDNN are used).

    Raises:
        KernelsUnavailable: the kernels are not installed or do not load here (the message says why).
    """
    ops = loader.ops()
    kernels = loader.kernels()
    return ops, (ops if kernels is not None and "f32_panels" in kernels.features else None)


def f32_panel_path() -> str:
    """The name of the loaded kernels' fp32 panel GEMM: ``avx512-panel``, else ``avx2-panel`` (same layout,
    same bits, 8-wide)."""
    kernels = loader.kernels()
    return "avx512-panel" if kernels is not None and "avx512" in kernels.features else "avx2-panel"


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the C++ ops cannot run here, or None."""
    if device.type != "cpu":
        return "needs the CPU device"
    if loader.kernels() is None:
        return "needs the pagoda-kernels library (make install builds it; the log says why it did not load)"
    return None


@functools.cache
def onednn_bf16_packs() -> bool:
    """Whether oneDNN packs bf16 linear weights on this CPU: its reorder needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT and raises elsewhere (AVX2 alone, e.g. AMD Zen 3), so it is tried once on a tiny weight."""
    if not _can_pack():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError as error:
        log.info("onednn_bf16_packing_unavailable", reason=str(error).splitlines()[0])
        return False
    return True


def _can_pack() -> bool:
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


LAYER_OPS: ImplementationRegistry[LayerOps] = ImplementationRegistry("layer ops")
LAYER_OPS.register(Implementation("cpp", lambda device, dtype: CppLayerOps(), unavailable, auto_priority=10))
LAYER_OPS.register(Implementation("torch", lambda device, dtype: TorchLayerOps(), auto_priority=0))


def get_layer_ops(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32, batch_invariant: bool = False
) -> LayerOps:
    """The layer ops called ``name``; ``auto``: the C++ ops on a CPU where the installed kernels load, else
    torch. ``batch_invariant``: linear layers whose output rows are the same bits whatever else is in the step:
    the C++ ops on a CPU, ``auto`` on CUDA the Triton ones (models/triton_layer_ops.py); torch's own matmuls
    choose their blocking by the number of rows.

    Raises:
        ValueError: an unknown name, or ops this machine cannot run (batch-invariant: the torch ops).
    """
    ops = LAYER_OPS.create(name, device, dtype)
    if not batch_invariant:
        return ops
    if isinstance(ops, CppLayerOps):
        return CppLayerOps(batch_invariant=True)
    if name == "auto" and device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from executor_svc.models.triton_layer_ops import TritonLayerOps  # imports triton

        return TritonLayerOps(TorchLayerOps())
    reason = unavailable(device, dtype) or f"the {ops.name!r} layer ops were asked for"
    raise ValueError(f"batch-invariant linear layers need the cpp layer ops (CPU) or triton (CUDA): {reason}")
