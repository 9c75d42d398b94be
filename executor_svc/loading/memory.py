"""Process memory: what the executor holds (RSS), and handing freed heap back to the OS after the load."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Collects garbage and returns the heap's free pages to the OS (glibc ``malloc_trim``).

    Loading a checkpoint frees more than it keeps (fp32 copies dequantized or cast to the model dtype, a
    GGUF file's rows repacked into the kernels' panels); glibc keeps such freed memory in the process unless
    asked. Returns whether the trim ran (False off glibc).
    """
    gc.collect()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default), from /proc; 0 where there is none."""
    try:
        with open(f"/proc/{pid or os.getpid()}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
