"""Loads the installed C++ kernels (the pagoda-kernels distribution) once per process.

The kernels are built ahead of time into the environment that runs the
executor (``make install``, or the executor image's builder stage); here
nothing is compiled and nothing is written. The variant this CPU runs best
(see ``variants``) is loaded with ``torch.ops.load_library`` and its ops are
called as ``torch.ops.pagoda.*``. Without usable kernels one log line says
what is missing, why, and which torch code runs instead.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog
import torch

from executor_svc.native import variants

log = structlog.get_logger("executor")

PACKAGE = "pagoda_kernels"
MANIFEST = "manifest.json"
# What runs instead of each C++ path (for the log line).
FALLBACK = "torch attention with SDPA prefill, torch layer ops, oneDNN/MKL linear layers"


class KernelsUnavailable(RuntimeError):
    """The kernels cannot be used in this process; the message says why."""


@dataclasses.dataclass(frozen=True)
class Installed:
    """What pagoda-kernels installed: its folder, the torch it was built against and its variants."""

    folder: Path
    torch_version: str
    variants: tuple[variants.Variant, ...]
    libraries: dict[str, str]  # variant name -> library file name in `folder`


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The loaded kernels: which variant, from which file, and its ops (``torch.ops.pagoda``)."""

    variant: str
    library: Path
    ops: Any  # BoundOps of torch.ops.pagoda
    # Code paths compiled in (avx512, avx512_bf16, amx), from the library itself.
    features: frozenset[str]


class BoundOps:
    """``torch.ops.pagoda`` with each op bound once to its ``default`` overload.

    An attribute of ``torch.ops.pagoda`` is looked up anew on every access
    (about 3 us), and a decode step calls the kernels several hundred times;
    bound here, the lookup is a plain attribute read.
    """

    def __init__(self, namespace: Any) -> None:
        self._namespace = namespace

    def __getattr__(self, name: str) -> Any:  # only for names not bound yet
        if name.startswith("_"):
            raise AttributeError(name)
        packet = getattr(self._namespace, name)
        op = packet.default if "default" in packet.overloads() else packet
        setattr(self, name, op)
        return op


def installed(folder: Path | None = None) -> Installed:
    """Reads the manifest of the installed kernels (of this environment unless ``folder`` is given).

    Raises:
        KernelsUnavailable: pagoda-kernels is not installed, or its manifest is unreadable.
    """
    if folder is None:
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise KernelsUnavailable(f"pagoda-kernels is not installed in {sys.prefix} (make install builds it)")
        folder = Path(next(iter(spec.submodule_search_locations)))
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        entries = manifest["variants"]
        found = tuple(variants.Variant(e["name"], tuple(e["cflags"]), frozenset(e["requires"])) for e in entries)
        return Installed(folder, manifest["torch"], found, {e["name"]: e["library"] for e in entries})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KernelsUnavailable(f"the pagoda-kernels manifest in {folder} is unreadable ({exc})") from exc


def load(folder: Path | None = None, cpu_flags: Iterable[str] | None = None) -> Kernels:
    """Loads the best installed variant for this CPU (at most one per process: they share op names).

    Raises:
        KernelsUnavailable: nothing installed fits this torch and CPU, or the library fails to load.
    """
    found = installed(folder)
    if found.torch_version != torch.__version__:
        raise KernelsUnavailable(
            f"pagoda-kernels was built against torch {found.torch_version}, this is torch {torch.__version__} "
            "(make install rebuilds it)"
        )
    flags = variants.cpu_flags() if cpu_flags is None else frozenset(cpu_flags)
    variant = variants.choose(found.variants, flags)
    if variant is None:
        names = ", ".join(v.name for v in found.variants) or "none"
        closest = min(found.variants, key=lambda v: len(v.requires - flags), default=None)
        lacks = f"; for {closest.name} it lacks {' '.join(sorted(closest.requires - flags))}" if closest else ""
        raise KernelsUnavailable(f"no installed variant runs on this CPU (installed: {names}{lacks})")
    library = found.folder / found.libraries[variant.name]
    try:
        torch.ops.load_library(str(library))
        ops = BoundOps(torch.ops.pagoda)
        features = frozenset(ops.cpu_features())
    except (OSError, RuntimeError, AttributeError) as exc:
        raise KernelsUnavailable(f"{library} failed to load ({exc})") from exc
    return Kernels(variant.name, library, ops, features)


@functools.cache
def _load_once() -> Kernels | KernelsUnavailable:
    try:
        return load()
    except KernelsUnavailable as exc:
        log.warning("native_kernels_unavailable", reason=str(exc), fallback=FALLBACK)
        return exc


def kernels() -> Kernels | None:
    """The kernels of this process (loaded on first use), or None after one log line saying why not."""
    result = _load_once()
    return result if isinstance(result, Kernels) else None


def ops() -> Any:
    """``torch.ops.pagoda`` of the loaded kernels.

    Raises:
        KernelsUnavailable: they cannot be loaded (the message says why).
    """
    result = _load_once()
    if isinstance(result, KernelsUnavailable):
        raise result
    return result.ops


def loaded() -> Kernels | None:
    """The kernels if something already loaded them (never loads)."""
    if _load_once.cache_info().currsize == 0:
        return None
    return kernels()
