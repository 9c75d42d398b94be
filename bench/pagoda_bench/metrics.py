"""Per-request records and the metrics of ``vllm bench serve``.

All times are seconds relative to the start of the benchmark run; reported
latencies are in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50.0, 90.0, 99.0)
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What happened to one benchmark request.

    Attributes:
        index: position in the workload.
        prompt_len: prompt tokens.
        wanted_output_len: output tokens asked for.
        start_s: when it was sent.
        chunk_times_s: arrival time of each response chunk carrying tokens.
        chunk_num_tokens: tokens in each of those chunks.
        success: it finished without error.
        error: the error, when it failed.
        cached_tokens: prompt tokens served from the prefix cache.
    """

    index: int
    prompt_len: int
    wanted_output_len: int
    start_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)
    success: bool = False
    error: str = ""
    cached_tokens: int = 0

    @property
    def output_len(self) -> int:
        """Output tokens received (useful tokens only)."""
        return sum(self.chunk_num_tokens)

    @property
    def ttft_s(self) -> float:
        """Time to first token."""
        return self.chunk_times_s[0] - self.start_s

    @property
    def e2el_s(self) -> float:
        """End-to-end latency (to the last token)."""
        return self.chunk_times_s[-1] - self.start_s

    @property
    def tpot_s(self) -> float:
        """(E2E − TTFT) / (output tokens − 1); 0 for a single output token."""
        if self.output_len <= 1:
            return 0.0
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive chunks (inter-token latencies)."""
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict with the derived latencies."""
        out: dict[str, object] = asdict(self)
        out["output_len"] = self.output_len
        if self.success and self.chunk_times_s:
            out.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2el_s=self.e2el_s)
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean, median, std, p90, p99 of ``values_s`` (seconds), in ms."""
    if not values_s:
        return {"mean": math.nan, "median": math.nan, "std": math.nan, "p90": math.nan, "p99": math.nan}
    mean = sum(values_s) / len(values_s)
    variance = sum((v - mean) ** 2 for v in values_s) / len(values_s)
    return {
        "mean": mean * 1e3,
        "median": percentile(values_s, 50.0) * 1e3,
        "std": math.sqrt(variance) * 1e3,
        "p90": percentile(values_s, 90.0) * 1e3,
        "p99": percentile(values_s, 99.0) * 1e3,
    }


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (ms).

    Raises:
        ValueError: unknown metric name or a non-positive value.
    """
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"bad goodput SLO {spec!r}: expected one of {SLO_NAMES} as NAME:MS")
        slos[name] = float(value)
        if slos[name] <= 0:
            raise ValueError(f"goodput SLO {spec!r} must be positive")
    return slos


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful record meets every SLO (ms)."""
    latencies_ms = {"ttft": record.ttft_s * 1e3, "tpot": record.tpot_s * 1e3, "e2el": record.e2el_s * 1e3}
    return all(latencies_ms[name] <= limit for name, limit in slos_ms.items())


def compute_metrics(
    records: Sequence[RequestRecord], duration_s: float, slos_ms: Mapping[str, float] | None = None
) -> dict[str, object]:
    """The benchmark's metrics over completed requests.

    Args:
        records: every request (failed ones count only in ``failed``).
        duration_s: wall time of the run.
        slos_ms: goodput SLOs by name (``ttft``, ``tpot``, ``e2el``), in ms.
    """
    done = [r for r in records if r.success and r.output_len > 0]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    metrics: dict[str, object] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "ttft_ms": summarize_ms([r.ttft_s for r in done]),
        "tpot_ms": summarize_ms([r.tpot_s for r in done if r.output_len > 1]),
        "itl_ms": summarize_ms([gap for r in done for gap in r.itls_s]),
        "e2el_ms": summarize_ms([r.e2el_s for r in done]),
    }
    if slos_ms:
        num_good = sum(meets_slos(r, slos_ms) for r in done)
        metrics["goodput_slos_ms"] = dict(slos_ms)
        metrics["goodput"] = num_good / duration_s
    return metrics


def tokens_per_second_series(records: Sequence[RequestRecord], bin_s: float = 1.0) -> list[tuple[float, float]]:
    """Output tokens/s in ``bin_s`` bins: ``[(bin start, tokens/s), ...]``."""
    events = [(t, n) for r in records for t, n in zip(r.chunk_times_s, r.chunk_num_tokens)]
    if not events:
        return []
    num_bins = int(max(t for t, _ in events) // bin_s) + 1
    counts = [0] * num_bins
    for t, n in events:
        counts[int(t // bin_s)] += n
    return [(i * bin_s, c / bin_s) for i, c in enumerate(counts)]
