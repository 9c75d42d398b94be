"""The builds of the C++ kernels (variants) and which one a CPU can run.

Pure Python without torch: ``csrc/setup.py`` reads it to build the variants
and the executor to choose one. ``make install`` builds ``native``
(``-march=native``: the build machine is the run machine); the executor
image builds the portable ones and the executor picks, from the CPU's flags
(``/proc/cpuinfo``), the first installed variant in ``PREFERENCE`` whose
required flags the CPU has.

The portable flag sets follow the code's ``#if`` guards: ``__AVX512F__``
(decode attention, argmax, fp32 panel GEMM), ``__AVX512BF16__`` (bf16
rotary and SiLU) and ``__AMX_TILE__``/``__AMX_BF16__`` (bf16 panel GEMM and
prefill), ``__AVX512VNNI__`` and ``__AMX_INT8__`` (the int8 GEMMs; every
CPU with AVX-512-bf16 has VNNI, every one with AMX-BF16 has AMX-INT8), plus
``avx2`` for the loops the compiler vectorises on CPUs without AVX-512. A
variant requires every flag its ``-march`` lets the compiler use, not only
those the guards test.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

# Flags of the x86-64 micro-architecture levels, as /proc/cpuinfo names them.
_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# Compiler macros (gcc/clang -dM -E) -> the /proc/cpuinfo flag of the same instructions.
MACRO_FLAGS = {
    "__SSE3__": "pni",
    "__SSSE3__": "ssse3",
    "__SSE4_1__": "sse4_1",
    "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__BMI__": "bmi1",
    "__BMI2__": "bmi2",
    "__LZCNT__": "abm",
    "__MOVBE__": "movbe",
    "__XSAVE__": "xsave",
    "__AES__": "aes",
    "__PCLMUL__": "pclmulqdq",
    "__SHA__": "sha_ni",
    "__ADX__": "adx",
    "__RDRND__": "rdrand",
    "__RDSEED__": "rdseed",
    "__GFNI__": "gfni",
    "__VAES__": "vaes",
    "__VPCLMULQDQ__": "vpclmulqdq",
    "__AVXVNNI__": "avx_vnni",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512CD__": "avx512cd",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16",
    "__AVX512IFMA__": "avx512ifma",
    "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512_vbmi2",
    "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
    "__AMX_INT8__": "amx_int8",
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One build of the kernels: its name, compiler flags and the CPU flags it needs."""

    name: str
    cflags: tuple[str, ...]
    requires: frozenset[str]

    def runs_on(self, cpu_flags: Iterable[str]) -> bool:
        """Whether a CPU with these flags has every instruction set this build may use."""
        return self.requires <= frozenset(cpu_flags)


NATIVE = "native"
# Portable builds for the executor image, x86-64 only.
PORTABLE = (
    Variant("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
            _X86_64_V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}),
    Variant("avx512-bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
            _X86_64_V4 | {"avx512_bf16", "avx512_vnni"}),
    Variant("avx512", ("-march=x86-64-v4",), _X86_64_V4),
    Variant("avx2", ("-march=x86-64-v3",), _X86_64_V3),
    Variant("x86-64", ("-march=x86-64",), frozenset()),
)  # fmt: skip
PORTABLE_NAMES = tuple(v.name for v in PORTABLE)
# Best first: the build tuned for this very CPU, then the widest instruction sets.
PREFERENCE = (NATIVE, *PORTABLE_NAMES)
# -O3 -ffast-math: the compiler vectorises the float reductions (3-4x here).
COMMON_CFLAGS = ("-O3", "-ffast-math")
# The C++ of every variant (csrc/), and the headers its sources include.
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "library.cpp",
    "cpu_ops.cpp",
    "cpu_gemm.cpp",
    "cpu_kernel.cpp",
    "cpu_prefill.cpp",
    "cpu_quant.cpp",
    "cpu_qblocks.cpp",
    "cpu_layers.cpp",
    "cpu_lora.cpp",
)
HEADERS = (
    "cpu_common.h",
    "amx.h",
    "bf16_dot.h",
    "cpu_kernel_common.h",
    "cpu_kernel_avx2.h",
    "cpu_kernel_avx512.h",
    "cpu_prefill_pack.h",
    "cpu_quant.h",
    "cpu_quant_avx2.h",
    "cpu_layer_ops.h",
)


def portable(name: str) -> Variant:
    """The portable variant of this name.

    Raises:
        ValueError: no such variant.
    """
    for variant in PORTABLE:
        if variant.name == name:
            return variant
    raise ValueError(f"unknown kernel variant {name!r}; portable ones: {', '.join(PORTABLE_NAMES)}")


def native(macros: Iterable[str]) -> Variant:
    """The ``-march=native`` variant, requiring the flags of the instruction sets its macros enable."""
    return Variant(NATIVE, ("-march=native",), frozenset(MACRO_FLAGS[m] for m in macros if m in MACRO_FLAGS))


def choose(installed: Iterable[Variant], cpu_flags: Iterable[str]) -> Variant | None:
    """The preferred installed variant that a CPU with ``cpu_flags`` runs, or None."""
    flags = frozenset(cpu_flags)
    by_name = {v.name: v for v in installed}
    for name in PREFERENCE:
        if name in by_name and by_name[name].runs_on(flags):
            return by_name[name]
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's flags (x86 ``flags``, Arm ``Features``); empty where there is no /proc/cpuinfo."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    match = re.search(r"(?m)^(?:flags|Features)\s*:(.*)$", text)
    return frozenset(match.group(1).split()) if match else frozenset()
