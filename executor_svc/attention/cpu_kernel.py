"""The C++ paged decode kernel (cpu_kernel.cpp), built with torch's JIT extension loader.

Building takes a minute or two once per machine (cached under
``~/.cache/torch_extensions``); ``python -m executor_svc.attention.cpu_kernel``
builds it ahead of time. ``auto`` backend selection uses it only when it is
already built, so no server start ever waits on a compiler.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

NAME = "pagoda_cpu_attention"
SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
# -ffast-math lets the compiler vectorise the float reductions (3-4x here).
CFLAGS = ["-O3", "-march=native", "-ffast-math"]


def build_directory() -> Path:
    """Where torch keeps this extension's build."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(NAME, verbose=False))


def is_built() -> bool:
    """True when a built library is cached (loading it then takes about a second)."""
    return any(build_directory().glob(f"{NAME}*.so"))


def can_build() -> bool:
    """True when a C++ compiler and ninja are on PATH."""
    return bool(shutil.which(os.environ.get("CXX", "c++")) and shutil.which("ninja"))


@functools.cache
def load():
    """Builds (if needed) and imports the extension module."""
    from torch.utils.cpp_extension import load as load_extension

    return load_extension(NAME, [str(SOURCE)], extra_cflags=CFLAGS, verbose=False)


if __name__ == "__main__":
    load()
    print(f"built {NAME} in {build_directory()}")
