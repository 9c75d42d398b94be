"""SIGTERM and SIGINT as SystemExit, so a benchmark's ``finally`` blocks stop the servers it started."""

from __future__ import annotations

import signal


def stop_on_signals() -> None:
    """Make SIGTERM/SIGINT raise SystemExit in the main thread.

    A benchmark killed by SIGTERM would otherwise die at once and leave the
    process groups it started running; as SystemExit its ``finally`` blocks
    and context managers run and killpg what they started.
    """

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
