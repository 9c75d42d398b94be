"""Choosing the device and dtypes ("auto" resolves to what is fast here)."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with AMX-bf16 or AVX512-bf16 (per /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool({"amx_bf16", "avx512_bf16"} & flags)
    except OSError:
        return False
    return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA or a CPU with bf16 units, else float32."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(sorted(_DTYPES))} or auto")
    return _DTYPES[name]


# KV cache dtypes beyond the model dtypes: rows quantized per (token, kv head), scales beside them (kv_cache.py).
_KV_ONLY_DTYPES = {"int8": torch.int8}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype``: ``auto`` is the model dtype; ``int8`` stores quantized rows with scales.

    Raises:
        ValueError: a name that is no KV cache dtype (fp8 included: int8 with per-row scales takes the same bytes
            and keeps more precision, and this CPU converts it faster; see docs/quantization.md).
    """
    if name == "auto":
        return model_dtype
    if name in _KV_ONLY_DTYPES:
        return _KV_ONLY_DTYPES[name]
    if name not in _DTYPES:
        names = ", ".join([*sorted(_DTYPES), *_KV_ONLY_DTYPES])
        raise ValueError(f"unsupported KV cache dtype {name!r}; use auto (the model dtype), {names}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")
