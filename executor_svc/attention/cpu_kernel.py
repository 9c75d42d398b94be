"""The C++ paged decode kernel (cpu_kernel.cpp and its headers), built with torch's JIT extension loader.

Building takes a minute or two once per machine (cached under
``~/.cache/torch_extensions``); ``python -m executor_svc.attention.cpu_kernel``
builds it ahead of time (``make install`` does). ``auto`` backend selection
uses it only when it is already built from the current source, so no server
start ever waits on a compiler, and a machine without a compiler or ninja
silently keeps the torch backend. ninja comes from PATH or from the ``ninja``
package of the running interpreter's environment.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
from pathlib import Path

NAME = "pagoda_cpu_attention"
SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
HEADERS = (SOURCE.with_name("cpu_kernel_common.h"), SOURCE.with_name("cpu_kernel_avx512.h"))
# -ffast-math lets the compiler vectorise the float reductions (3-4x here).
CFLAGS = ["-O3", "-march=native", "-ffast-math"]


def build_directory() -> Path:
    """Where torch keeps this extension's build."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(NAME, verbose=False))


def is_built() -> bool:
    """True when a library built from the current source is cached (loading it then takes about a second)."""
    try:
        source_mtime = max(path.stat().st_mtime for path in (SOURCE, *HEADERS))
        return any(lib.stat().st_mtime >= source_mtime for lib in build_directory().glob(f"{NAME}*.so"))
    except OSError:
        return False


def can_build() -> bool:
    """True when a C++ compiler and ninja are available."""
    return bool(shutil.which(os.environ.get("CXX", "c++")) and _ninja_dir())


def _ninja_dir() -> str | None:
    """Directory of the ninja to use: the ninja package's, else next to this interpreter, else PATH's.

    Always preferring the same one matters: a ninja of another version
    discards the build log and rebuilds.
    """
    candidates = []
    try:
        import ninja  # the PyPI package ships the binary

        candidates.append(Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    candidates.append(Path(sys.executable).parent)
    for directory in candidates:
        if os.access(directory / "ninja", os.X_OK):
            return str(directory)
    found = shutil.which("ninja")
    return os.path.dirname(found) if found else None


def _import_built():
    """Imports the newest cached library directly (no compiler or ninja involved)."""
    library = max(build_directory().glob(f"{NAME}*.so"), key=lambda lib: lib.stat().st_mtime)
    spec = importlib.util.spec_from_file_location(library.stem, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load():
    """Builds (if needed) and imports the extension module.

    Without a compiler or ninja, a library already built from the current
    source is imported as is.

    Raises:
        RuntimeError: the kernel is not built and cannot be, or the build failed.
    """
    if not can_build():
        if is_built():
            return _import_built()
        raise RuntimeError(f"{NAME} is not built and there is no C++ compiler with ninja to build it")
    from torch.utils.cpp_extension import load as load_extension

    ninja_dir = _ninja_dir()
    if shutil.which("ninja") != os.path.join(ninja_dir, "ninja"):  # torch's loader runs plain `ninja`
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    return load_extension(NAME, [str(SOURCE)], extra_cflags=CFLAGS, verbose=False)


def main() -> int:
    """Builds the kernel ahead of time; exits 0 without a compiler (the torch backend is used)."""
    if not (is_built() or can_build()):
        print(f"{NAME}: no C++ compiler or ninja; attention uses the torch backend", file=sys.stderr)
        return 0
    load()
    print(f"built {NAME} in {build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
