"""A plain progress bar on stderr (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``label [#####-----] done/total  tokens/s  elapsed``, redrawn in place.

    Redraws at most every ``min_interval_s``; on a stream that is not a
    terminal it prints one line per 10% instead.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        stream: TextIO | None = None,
        width: int = 30,
        min_interval_s: float = 0.2,
        enabled: bool = True,
    ) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.min_interval_s = min_interval_s
        self.enabled = enabled
        self.done = 0
        self.tokens = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, num_done: int = 0, num_tokens: int = 0) -> None:
        """Count finished requests and received tokens; redraw if due."""
        self.done += num_done
        self.tokens += num_tokens
        now = time.perf_counter()
        if now - self._last_draw >= self.min_interval_s or self.done == self.total:
            self._draw(now)

    def render(self, now: float | None = None) -> str:
        """The bar's text."""
        elapsed = (now or time.perf_counter()) - self._start
        filled = self.width * self.done // max(1, self.total)
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        bar = "#" * filled + "-" * (self.width - filled)
        return f"{self.label} [{bar}] {self.done}/{self.total}  {rate:.1f} tok/s  {elapsed:.1f}s"

    def _draw(self, now: float) -> None:
        if not self.enabled:
            return
        self._last_draw = now
        if self._tty:
            self.stream.write("\r" + self.render(now))
        else:
            decile = 10 * self.done // max(1, self.total)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.stream.write(self.render(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Final redraw and newline."""
        if self.enabled:
            self._draw(time.perf_counter())
            if self._tty:
                self.stream.write("\n")
                self.stream.flush()
