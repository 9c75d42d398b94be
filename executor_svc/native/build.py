"""Builds and imports our C++ extensions with torch's JIT extension loader.

Building takes a minute or two once per machine (cached under
``~/.cache/torch_extensions``); ``python -m executor_svc.native.build`` builds
every extension ahead of time (``make install`` does). Automatic selection
uses an extension only when it is already built from the current source, so
no server start ever waits on a compiler, and a machine without a compiler or
ninja silently keeps the torch code. ninja comes from PATH or from the
``ninja`` package of the running interpreter's environment.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import shutil
import sys
from pathlib import Path

# -ffast-math lets the compiler vectorise the float reductions (3-4x here).
CFLAGS = ("-O3", "-march=native", "-ffast-math")
_HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Extension:
    """One C++ extension: its module name, sources and the headers they include."""

    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()

    def build_directory(self) -> Path:
        """Where torch keeps this extension's build."""
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(self.name, verbose=False))

    def is_built(self) -> bool:
        """True when a library built from the current source is cached (loading it then takes about a second)."""
        try:
            source_mtime = max(path.stat().st_mtime for path in (*self.sources, *self.headers))
            return any(lib.stat().st_mtime >= source_mtime for lib in self.build_directory().glob(f"{self.name}*.so"))
        except OSError:
            return False

    def load(self):
        """Builds (if needed) and imports the module; see ``_load``."""
        return _load(self)


@functools.cache
def _load(extension: Extension):
    """Builds (if needed) and imports an extension module.

    Without a compiler or ninja, a library already built from the current
    source is imported as is.

    Raises:
        RuntimeError: the extension is not built and cannot be, or the build failed.
    """
    if not can_build():
        if extension.is_built():
            return _import_built(extension)
        raise RuntimeError(f"{extension.name} is not built and there is no C++ compiler with ninja to build it")
    from torch.utils.cpp_extension import load as load_extension

    ninja_dir = _ninja_dir()
    if shutil.which("ninja") != os.path.join(ninja_dir, "ninja"):  # torch's loader runs plain `ninja`
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    sources = [str(path) for path in extension.sources]
    return load_extension(extension.name, sources, extra_cflags=list(CFLAGS), verbose=False)


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


def _import_built(extension: Extension):
    """Imports the newest cached library directly (no compiler or ninja involved)."""
    library = max(extension.build_directory().glob(f"{extension.name}*.so"), key=lambda lib: lib.stat().st_mtime)
    spec = importlib.util.spec_from_file_location(library.stem, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ATTENTION_DIR = _HERE.parent / "attention"
ATTENTION = Extension(
    "pagoda_cpu_attention",
    (_ATTENTION_DIR / "cpu_kernel.cpp",),
    (_ATTENTION_DIR / "cpu_kernel_common.h", _ATTENTION_DIR / "cpu_kernel_avx512.h", _HERE / "cpu_common.h"),
)
OPS = Extension("pagoda_cpu_ops", (_HERE / "cpu_ops.cpp",), (_HERE / "cpu_common.h",))
GEMM = Extension("pagoda_cpu_gemm", (_HERE / "cpu_gemm.cpp",), (_HERE / "cpu_common.h", _HERE / "amx.h"))
PREFILL = Extension(
    "pagoda_cpu_prefill", (_ATTENTION_DIR / "cpu_prefill.cpp",), (_HERE / "cpu_common.h", _HERE / "amx.h")
)
EXTENSIONS = (ATTENTION, OPS, GEMM, PREFILL)


def main() -> int:
    """Builds every extension ahead of time; exits 0 without a compiler (the torch code is used)."""
    for extension in EXTENSIONS:
        if not (extension.is_built() or can_build()):
            print(f"{extension.name}: no C++ compiler or ninja; the torch code is used", file=sys.stderr)
            continue
        extension.load()
        print(f"built {extension.name} in {extension.build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
