"""One process per tier directory: an exclusive flock held for the process's life.

The kernel releases the lock when the process ends, however it ends (SIGKILL
included), so a restarted executor takes its directory back at once. A
directory held by another live process is refused, naming it and its holder;
asked to (``next_free``, what ``pagoda serve`` does for its default
directories), the first free ``PATH.1``, ``PATH.2``, ... is taken instead.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = ".lock"
# How many PATH.N alternatives next_free tries.
MAX_ALTERNATIVES = 64


class TierDirBusy(Exception):
    """The tier directory is held by another live process."""


class TierDirLock:
    """The lock on one tier directory, held until release() or the process ends."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def lock_tier_dir(directory: Path, next_free: bool = False) -> TierDirLock:
    """Creates and locks ``directory`` (or, with next_free, the first free PATH.N).

    Raises:
        TierDirBusy: held by another process (every alternative too, with next_free).
    """
    candidates = [directory]
    if next_free:
        candidates += [directory.with_name(f"{directory.name}.{n}") for n in range(1, MAX_ALTERNATIVES + 1)]
    holder = 0
    for candidate in candidates:
        lock = _try_lock(candidate)
        if isinstance(lock, TierDirLock):
            return lock
        holder = holder or lock
        if not next_free:
            break
    what = f"{directory} (and {directory.name}.1..{MAX_ALTERNATIVES})" if next_free else str(directory)
    raise TierDirBusy(
        f"--kv-offload-dir {what} is in use by another process (pid {holder or 'unknown'}); "
        "give each executor its own directory"
    )


def _try_lock(directory: Path) -> TierDirLock | int:
    """The lock, or the pid of the process holding it (0 when it cannot be read)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return TierDirLock(directory, fd)


def _read_pid(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    except ValueError:
        return 0
