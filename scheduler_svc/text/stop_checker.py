"""Stop strings over streamed text, one checker per request.

Text that could be the start of a stop string is held back until the next delta
shows whether it is, so a client never receives text that later turns out to
belong to a stop string. The held tail is shorter than the longest stop string,
so each call costs the same however long the output grows.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Finds the first stop string in a request's text stream.

    "First" is the stop string that is complete earliest in the stream (the
    longer one when two end at the same character), so the result does not
    depend on how the text was split into deltas.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        """Raises ValueError on an empty stop string (it would match everywhere)."""
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = tuple(dict.fromkeys(stop))
        self._include_stop_str = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Received text not yet emitted: a possible start of a stop string.
        self._held = ""
        self.matched: str | None = None

    @property
    def has_stops(self) -> bool:
        """Whether any stop string is watched for."""
        return bool(self._stops)

    def process(self, delta: str) -> tuple[str, str | None]:
        """Takes the next text delta.

        Returns:
            (text safe to emit now, matched stop string or None). On a match the
            text ends at the stop string (or after it when it is included) and
            later calls return ("", None).
        """
        if self.matched is not None:
            return "", None
        if not self._stops:
            return delta, None
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.matched, self._held = stop, ""
            end = start + len(stop) if self._include_stop_str else start
            return text[:end], stop
        num_held = self._num_partial_tail(text)
        self._held = text[len(text) - num_held :]
        return text[: len(text) - num_held], None

    def flush(self) -> str:
        """At finish without a match: the held-back tail ("" after a match)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first, or None."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _num_partial_tail(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        for num in range(min(len(text), self._max_stop_len - 1), 0, -1):
            tail = text[len(text) - num :]
            if any(stop.startswith(tail) for stop in self._stops):
                return num
        return 0
