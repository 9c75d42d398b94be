"""Benchmark metric arithmetic on synthetic timestamps (exact expectations)."""

from __future__ import annotations

import math

import pytest

from pagoda_bench.metrics import (
    RequestRecord,
    compute_metrics,
    parse_goodput,
    percentile,
    summarize_ms,
    tokens_per_second_series,
)


def _record(index: int, start: float, times: list[float], tokens: list[int], prompt_len: int = 10) -> RequestRecord:
    return RequestRecord(index, prompt_len, sum(tokens), start, list(times), list(tokens), success=True)


def test_ttft_tpot_itl_e2el_of_one_record():
    record = _record(0, 1.0, [1.5, 1.7, 2.0, 2.6], [1, 1, 1, 1])
    assert record.ttft_s == pytest.approx(0.5, abs=1e-12)
    assert record.e2el_s == pytest.approx(1.6, abs=1e-12)
    # TPOT = (E2E - TTFT) / (output tokens - 1) = 1.1 / 3
    assert record.tpot_s == pytest.approx(1.1 / 3, abs=1e-12)
    assert record.itls_s == pytest.approx([0.2, 0.3, 0.6], abs=1e-12)


def test_tpot_counts_tokens_not_chunks():
    # 2 chunks carrying 5 tokens: TPOT divides by 4 tokens, ITL has one gap.
    record = _record(0, 0.0, [1.0, 3.0], [1, 4])
    assert record.output_len == 5
    assert record.tpot_s == pytest.approx(0.5, abs=1e-12)
    assert record.itls_s == pytest.approx([2.0], abs=1e-12)


def test_tpot_of_single_token_is_zero():
    assert _record(0, 0.0, [0.25], [1]).tpot_s == 0.0


def test_percentile_interpolates_linearly():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_summary_in_milliseconds():
    stats = summarize_ms([0.1, 0.2, 0.3, 0.4])
    assert stats["mean"] == pytest.approx(250.0)
    assert stats["median"] == pytest.approx(250.0)
    assert stats["p90"] == pytest.approx(370.0)
    assert stats["p99"] == pytest.approx(397.0)
    assert stats["std"] == pytest.approx(math.sqrt(0.0125) * 1e3)


def _three_records() -> list[RequestRecord]:
    return [
        # ttft 0.1, e2e 0.5, 5 tokens -> tpot 0.1
        _record(0, 0.0, [0.1, 0.2, 0.3, 0.4, 0.5], [1] * 5, prompt_len=20),
        # ttft 0.3, e2e 1.1, 3 tokens -> tpot 0.4
        _record(1, 0.0, [0.3, 0.7, 1.1], [1, 1, 1], prompt_len=30),
        # ttft 0.2 (sent at 1.0), e2e 1.0, 2 chunks of 2 tokens -> tpot 0.8 / 3
        _record(2, 1.0, [1.2, 2.0], [2, 2], prompt_len=50),
    ]


def test_run_metrics_throughput_and_latencies():
    records = _three_records() + [RequestRecord(3, 99, 8, 0.0, error="UNAVAILABLE: down", cached_tokens=5)]
    records[1].cached_tokens = 16
    metrics = compute_metrics(records, duration_s=2.0)
    assert metrics["completed"] == 3 and metrics["failed"] == 1
    assert metrics["total_input_tokens"] == 100
    assert metrics["total_output_tokens"] == 12
    assert metrics["total_cached_tokens"] == 16
    assert metrics["request_throughput"] == pytest.approx(1.5)
    assert metrics["output_throughput"] == pytest.approx(6.0)
    assert metrics["total_token_throughput"] == pytest.approx(56.0)
    assert metrics["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert metrics["ttft_ms"]["median"] == pytest.approx(200.0)
    assert metrics["e2el_ms"]["mean"] == pytest.approx((500 + 1100 + 1000) / 3)
    assert metrics["tpot_ms"]["mean"] == pytest.approx((100 + 400 + 800 / 3) / 3)
    # ITL gaps: 4 x 0.1, 2 x 0.4, 1 x 0.8 -> 7 gaps
    assert metrics["itl_ms"]["mean"] == pytest.approx((0.4 + 0.8 + 0.8) / 7 * 1e3)
    assert metrics["itl_ms"]["median"] == pytest.approx(100.0)
    assert "goodput" not in metrics


def test_goodput_counts_requests_meeting_every_slo():
    records = _three_records()
    # ttft <= 250 ms drops record 1; tpot <= 300 ms keeps records 0 and 2.
    metrics = compute_metrics(records, 2.0, parse_goodput(["ttft:250", "tpot:300"]))
    assert metrics["goodput"] == pytest.approx(1.0)
    metrics = compute_metrics(records, 2.0, parse_goodput(["e2el:1050"]))
    assert metrics["goodput"] == pytest.approx(1.0)
    metrics = compute_metrics(records, 2.0, parse_goodput(["e2el:1100"]))
    assert metrics["goodput"] == pytest.approx(1.5)


@pytest.mark.parametrize("spec", ["ttfb:10", "ttft", "tpot:-1", "e2el:0"])
def test_bad_goodput_specs(spec):
    with pytest.raises(ValueError):
        parse_goodput([spec])


def test_tokens_per_second_series():
    records = _three_records()
    series = tokens_per_second_series(records, bin_s=1.0)
    # bin 0: 5 + 2 (0.3, 0.7) = 7 tokens; bin 1: 1 (1.1) + 2 (1.2) = 3; bin 2: 2 (2.0)
    assert series == [(0.0, 7.0), (1.0, 3.0), (2.0, 2.0)]
