"""The ``--quantization`` modes by name, and what the chosen one does to a model's linear weights.

A mode is one ``QuantMode`` entry in ``MODES``: how it quantizes a dense
weight at load (or keeps it dense) and which GGUF tensor types the loader
keeps as stored. ``resolve_quantization`` turns the flags into the effective
``Quantization`` of an executor before any weight is read, so a bad flag
fails at start with the choices named. ``auto`` is ``gguf`` for a .gguf file
(its blocks as stored), else ``none``. ``--quantized-activations`` picks the
activations of the quantized kernels: ``int8`` (dynamic, per row and 64
features for int8 weights, per 32 for GGUF blocks), ``bf16`` (weight-only) or
``auto`` (int8 in steps of up to ``WIDEN_ABOVE_ROWS`` rows where the C++
kernels run, bf16 past them and on CUDA).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from executor_svc.models.layer_ops import LayerOps
from executor_svc.native import loader
from executor_svc.quant import gguf_blocks, int8
from executor_svc.quant.base import QuantizedLinear
from executor_svc.quant.quantized_ops import QuantizedLayerOps

log = structlog.get_logger(__name__)

ACTIVATIONS = ("auto", "int8", "bf16")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the quantized layers run: the device, the model dtype and the kernels (None: torch code)."""

    device: torch.device
    dtype: torch.dtype
    kernels: Any  # executor_svc.native.loader.Kernels, when the layer ops are the C++ ones
    activations: str  # one of ACTIVATIONS
    # One activation kind at every step size (a row's bits must not depend on how many rows the step has), and
    # only the C++ kernels (torch's matmuls choose their blocking by the number of rows).
    batch_invariant: bool = False

    @property
    def kernel_ops(self) -> Any:
        return None if self.kernels is None else self.kernels.ops

    def int8_path(self) -> tuple[str, int]:
        """(what runs int8 layers, widen_above): the kernels where they take this dtype, else torch."""
        path = int8.int8_path(self.kernels, self.device)
        if self.dtype not in (torch.float32, torch.bfloat16) or (
            path in int8.VECTOR_PATHS and self.activations == "bf16"
        ):
            path = "torch-int8"  # the kernels take fp32 / bf16 rows; VNNI and AVX2 have no bf16 widening
        if self.batch_invariant and path == "torch-int8":
            raise ValueError(
                "batch-invariant int8 layers need the C++ int8 kernels (AMX-INT8, AVX512-VNNI or AVX2) on fp32 / "
                "bf16 rows, and on VNNI or AVX2 int8 activations"
            )
        if self.activations == "int8" or path in int8.VECTOR_PATHS:
            return path, int8.ALWAYS
        if self.activations == "bf16" or self.device.type == "cuda":
            return path, 0
        # Batch-invariant auto: int8 activations at every step on AMX-INT8 too (never widened past 128 rows).
        return path, int8.ALWAYS if self.batch_invariant else int8.WIDEN_ABOVE_ROWS

    def block_kernels(self) -> tuple[Any, int]:
        """(the kernels' ops for GGUF blocks, or None for the torch code; widen_above)."""
        kernels = self.kernels
        usable = (
            kernels is not None and self.device.type == "cpu" and bool({"avx512_vnni", "avx2_int8"} & kernels.features)
        )
        # Widened steps run on the bf16 AMX blocks, or without AMX on AVX512-BF16 dot products.
        widens = usable and (
            "avx512_bf16" in kernels.features or ("amx" in kernels.features and kernels.ops.amx_ready())
        )
        if self.batch_invariant and (not usable or (self.activations == "bf16" and not widens)):
            raise ValueError(
                "batch-invariant GGUF layers need the C++ block kernels (AVX512-VNNI or AVX2; bf16 activations "
                "also AVX512-BF16 or AMX)"
            )
        if not usable:
            return None, int8.ALWAYS  # the torch code is weight-only whatever widen_above says
        if self.activations == "bf16":
            return (kernels.ops, 0) if widens else (None, int8.ALWAYS)
        if self.activations == "int8" or not widens or self.batch_invariant:  # batch-invariant: one kind
            return kernels.ops, int8.ALWAYS
        return kernels.ops, gguf_blocks.WIDEN_ABOVE_ROWS


@dataclasses.dataclass(frozen=True)
class QuantMode:
    """One ``--quantization`` mode."""

    name: str
    help: str
    # (dense weight [N, K] in the model dtype, target) -> its quantized layer, or None: it stays dense.
    quantize: Callable[[torch.Tensor, Target], QuantizedLinear | None]
    # Whether the GGUF loader keeps tensors of a GGMLQuantizationType as stored (else it dequantizes them);
    # None: it dequantizes every one.
    keeps_gguf: Callable[[Any], bool] | None = None
    # The mode keeps a GGUF file's blocks: refused for a checkpoint folder.
    gguf_only: bool = False


def _dense(weight: torch.Tensor, target: Target) -> None:
    return None


def _int8(weight: torch.Tensor, target: Target) -> QuantizedLinear:
    path, widen_above = target.int8_path()
    return int8.int8_linear(weight, path, target.kernel_ops, widen_above)


def _blocks_of(qtype: gguf_blocks.Q) -> Callable[[torch.Tensor, Target], QuantizedLinear]:
    def quantize(weight: torch.Tensor, target: Target) -> QuantizedLinear:
        return gguf_blocks.block_linear(gguf_blocks.quantize_blocks(weight, qtype), *target.block_kernels())

    return quantize


def _kept(*qtypes: gguf_blocks.Q) -> Callable[[Any], bool]:
    return lambda qtype: qtype in qtypes


MODES: dict[str, QuantMode] = {}


def register(mode: QuantMode) -> None:
    """Adds a mode (its name must be new)."""
    if mode.name in MODES or mode.name == "auto":
        raise ValueError(f"quantization mode {mode.name!r} is registered already")
    MODES[mode.name] = mode


register(QuantMode("none", "weights in --dtype (a GGUF file is dequantized at load)", _dense))
register(QuantMode("int8", "int8 weights, one scale per output channel, quantized at load", _int8))
register(
    QuantMode("gguf", "a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks as stored", _dense, _kept(*gguf_blocks.KEPT_TYPES), True)
)
for _qtype in (gguf_blocks.Q.Q8_0, gguf_blocks.Q.Q4_0):
    register(
        QuantMode(
            _qtype.name.lower(),
            f"GGUF {_qtype.name} blocks: kept as stored, or quantized at load",
            _blocks_of(_qtype),
            _kept(_qtype),
        )
    )


def mode_names() -> tuple[str, ...]:
    """Every name --quantization takes."""
    return ("auto", *MODES)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """An executor's effective quantization: its mode and where the layers run."""

    mode: QuantMode
    target: Target

    @property
    def name(self) -> str:
        return self.mode.name

    def quantize(self, weight: Any) -> QuantizedLinear | None:
        """A linear weight's quantized layer (GGUF blocks: always), or None when it stays dense."""
        if isinstance(weight, gguf_blocks.GgufWeight):
            return gguf_blocks.block_linear(weight, *self.target.block_kernels())
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            return None
        return self.mode.quantize(weight, self.target)

    def effective(self, ops: Any) -> str:
        """What Describe reports once the model is built: the mode, and for ``gguf`` the block types it kept."""
        if self.mode.name == "gguf":
            formats = ops.formats if isinstance(ops, QuantizedLayerOps) else {}
            return "gguf:" + "+".join(formats) if formats else "gguf"
        return self.mode.name

    def wrap(self, ops: LayerOps) -> LayerOps:
        """The layer ops the model is built with (``ops`` itself when nothing is quantized)."""
        return ops if self.mode.name == "none" else QuantizedLayerOps(ops, self.quantize)  # type: ignore[return-value]


def resolve_quantization(
    name: str,
    activations: str,
    model_path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    ops: LayerOps,
    batch_invariant: bool = False,
) -> Quantization:
    """The effective quantization for these flags, model and layer ops (``auto``: gguf for a .gguf file, else none).

    ``batch_invariant``: the quantized layers keep one activation kind at every step size and run only the C++
    kernels (checked here, before any weight is read).

    Raises:
        ValueError: an unknown mode or activations choice, or a mode this model cannot take (named).
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown --quantized-activations {activations!r}; use one of {', '.join(ACTIVATIONS)}")
    resolved = name if name != "auto" else "gguf" if Path(model_path).suffix == ".gguf" else "none"
    mode = MODES.get(resolved)
    if mode is None:
        raise ValueError(f"unknown --quantization {name!r}; use one of {', '.join(mode_names())}")
    if mode.gguf_only and Path(model_path).suffix != ".gguf":
        raise ValueError(f"--quantization {name} keeps a GGUF file's blocks; {model_path} is not a .gguf file")
    kernels = loader.kernels() if ops.name == "cpp" else None
    target = Target(device, dtype, kernels, activations, batch_invariant)
    if batch_invariant and mode.name == "int8":
        target.int8_path()  # raises where the int8 layers could not be batch-invariant
    elif batch_invariant and mode.name != "none":
        target.block_kernels()
    _warn_if_slower(mode.name, target)
    return Quantization(mode, target)


def _warn_if_slower(mode: str, target: Target) -> None:
    """Logs ``quantized_layers_on_torch_code`` when a CPU's quantized layers would run the torch code (no C++
    kernels for them: a CPU without AVX2 + FMA, or the torch layer ops): weights are dequantized in every call
    there, so the model takes less memory but runs slower than unquantized (W-mixed int8 on the torch code ran
    0.37x bf16 on an AMD Zen 3, before the AVX2 int8 kernels)."""
    if target.device.type != "cpu" or mode == "none":
        return
    slow = target.int8_path()[0] == "torch-int8" if mode == "int8" else target.block_kernels()[0] is None
    if slow:
        log.warning(
            "quantized_layers_on_torch_code",
            quantization=mode,
            reason="the CPU kernels for quantized layers need AVX2 + FMA and the cpp layer ops",
            effect="less memory, slower than --quantization none here",
        )
