"""pagoda-kernels: the executor's C++ CPU kernels, one shared library per variant.

Built against the torch of the environment it installs into, so install it
without build isolation (no second torch is downloaded):

    PAGODA_KERNEL_VARIANTS=native pip install --no-build-isolation --no-deps executor_svc/native/csrc

``PAGODA_KERNEL_VARIANTS``: ``native`` (default; ``-march=native``, for the
machine that builds it), ``portable`` (every portable variant, for images)
or a comma-separated list of names (executor_svc/native/variants.py). Each
library registers the ``pagoda`` ops with the torch dispatcher; the executor
loads one of them with ``torch.ops.load_library``. ``manifest.json`` records
each library's variant, flags and required CPU flags, and the torch version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # variants.py, shared with the executor (no torch, no package import)
import variants  # noqa: E402

# Python's own build flags come first on the command line (-g -fwrapv): no debug
# info (10x the library size and slower builds), and signed overflow left undefined.
PYTHON_CFLAGS_OFF = ("-g0", "-fno-wrapv")


def requested_variants() -> list[variants.Variant]:
    """The variants PAGODA_KERNEL_VARIANTS asks for."""
    spec = os.environ.get("PAGODA_KERNEL_VARIANTS", variants.NATIVE)
    chosen: list[variants.Variant] = []
    for name in filter(None, (part.strip() for part in spec.split(","))):
        if name == variants.NATIVE:
            chosen.append(variants.native(_native_macros()))
        elif name == "portable":
            chosen.extend(variants.PORTABLE)
        else:
            chosen.append(variants.portable(name))
    if not chosen:
        raise SystemExit("PAGODA_KERNEL_VARIANTS names no variant")
    return chosen


def _native_macros() -> list[str]:
    """The macros the compiler defines for -march=native (which instruction sets it may use)."""
    compiler = os.environ.get("CXX", "c++")
    command = [compiler, "-march=native", "-dM", "-E", "-x", "c++", os.devnull]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout
    return [line.split()[1] for line in out.splitlines() if line.startswith("#define ")]


def library_name(variant: variants.Variant) -> str:
    """The extension name of a variant's library (a valid identifier)."""
    return "pagoda_kernels._C_" + variant.name.replace("-", "_")


def extension(variant: variants.Variant) -> CppExtension:
    """One variant's library: every source, compiled with its flags."""
    return CppExtension(
        library_name(variant),
        [str(HERE / source) for source in variants.SOURCES],
        extra_compile_args=[*variants.COMMON_CFLAGS, *variant.cflags, *PYTHON_CFLAGS_OFF],
        depends=[str(HERE / header) for header in variants.HEADERS],
        py_limited_api=True,  # no Python API used: not tied to one CPython, no libtorch_python
    )


class BuildVariants(BuildExtension):
    """Builds each variant in its own temporary folder and writes the manifest next to the libraries."""

    def build_extension(self, ext) -> None:
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])  # same sources, other flags
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base

    def run(self) -> None:
        package = Path(self.build_lib) / "pagoda_kernels"
        for stale in package.glob("_C_*"):  # another variant set built in this tree earlier: not in this wheel
            stale.unlink()
        super().run()
        entries = [
            {
                "name": variant.name,
                "library": Path(self.get_ext_filename(library_name(variant))).name,
                "cflags": [*variants.COMMON_CFLAGS, *variant.cflags],
                "requires": sorted(variant.requires),
            }
            for variant in VARIANTS
        ]
        package.mkdir(parents=True, exist_ok=True)
        (package / "manifest.json").write_text(
            json.dumps({"torch": torch.__version__, "variants": entries}, indent=2) + "\n"
        )


def use_precompiled_header() -> None:
    """Compile through pch_cxx.py, which parses ATen once per variant instead of once per source."""
    if os.environ.get("CXX", "").endswith("pch_cxx.py"):
        return
    os.environ["PAGODA_REAL_CXX"] = os.environ.get("CXX", "c++")
    os.environ["CXX"] = str(HERE / "pch_cxx.py")


VARIANTS = requested_variants()
use_precompiled_header()

setup(
    name="pagoda-kernels",
    version="0.1.0",
    description="Pagoda executor's C++ CPU kernels (torch.ops.pagoda), one library per CPU variant",
    packages=["pagoda_kernels"],
    ext_modules=[extension(variant) for variant in VARIANTS],
    cmdclass={"build_ext": BuildVariants},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    python_requires=">=3.10",
    zip_safe=False,
)
