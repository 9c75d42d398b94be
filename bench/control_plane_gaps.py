"""Inter-token gaps as a mergeable histogram: each load process fills one, the benchmark adds them up.

A gap is the time between two responses of the same request that carry
tokens, as the client sees them. Buckets are geometric (each 1% wider than
the one before), so a percentile read off the merged histogram is within
0.5% of the exact one at any scale, from microseconds to seconds, and a
report stays a few hundred numbers however many gaps it counts.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping

BUCKET_RATIO = 1.01
_LOG_RATIO = math.log(BUCKET_RATIO)
# Shorter gaps (two responses read in one pass of the event loop) count in the bucket of this one.
MIN_GAP_S = 1e-7


class GapHistogram:
    """Counts of gaps (seconds) by geometric bucket, and the tokens the responses that ended them carried."""

    def __init__(self, counts: Mapping[int, int] | None = None, num_tokens: int = 0) -> None:
        self.counts: collections.Counter[int] = collections.Counter(counts or {})
        self.num_tokens = num_tokens

    @property
    def num_gaps(self) -> int:
        """Gaps counted."""
        return sum(self.counts.values())

    def add(self, gap_s: float, num_tokens: int) -> None:
        """Count one gap, ended by a response of `num_tokens` tokens."""
        self.counts[math.floor(math.log(max(gap_s, MIN_GAP_S)) / _LOG_RATIO)] += 1
        self.num_tokens += num_tokens

    def quantile(self, q: float) -> float:
        """The gap (seconds) below which a fraction `q` of the gaps lie; NaN when none was counted."""
        total = self.num_gaps
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= q * total:
                return BUCKET_RATIO ** (bucket + 0.5)  # the bucket's geometric middle
        return math.nan

    def tokens_per_response(self) -> float:
        """Mean tokens of the responses that ended a gap; NaN when none was counted."""
        return self.num_tokens / self.num_gaps if self.counts else math.nan

    def to_json(self) -> dict:
        """A JSON-able form (`from_json` reads it back)."""
        return {"counts": {str(b): n for b, n in self.counts.items()}, "num_tokens": self.num_tokens}

    @classmethod
    def from_json(cls, data: Mapping) -> GapHistogram:
        """The histogram `to_json` wrote."""
        return cls({int(b): n for b, n in data["counts"].items()}, data["num_tokens"])

    @classmethod
    def merged(cls, histograms: Iterable[GapHistogram]) -> GapHistogram:
        """One histogram holding the gaps of all of `histograms`."""
        total = cls()
        for histogram in histograms:
            total.counts.update(histogram.counts)
            total.num_tokens += histogram.num_tokens
        return total
