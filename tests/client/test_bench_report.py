"""The text report, JSON file and PNG charts of a benchmark run."""

from __future__ import annotations

import json

import pytest

from pagoda_bench.metrics import RequestRecord, compute_metrics
from pagoda_bench.report import format_report, write_json, write_plots

RECORDS = [
    RequestRecord(0, 10, 3, 0.0, [0.1, 0.2, 0.3], [1, 1, 1], success=True),
    RequestRecord(1, 20, 2, 0.0, [0.2, 1.4], [1, 1], success=True),
    RequestRecord(2, 5, 4, 0.0, error="DEADLINE_EXCEEDED: Deadline Exceeded"),
]


def test_report_lines():
    metrics = compute_metrics(RECORDS, 2.0, {"ttft": 150.0})
    lines = format_report("pagoda", metrics).splitlines()
    assert "Serving Benchmark Result (pagoda)" in lines[0]
    assert lines[1].split() == ["Successful", "requests:", "2"]
    assert lines[2].split() == ["Failed", "requests:", "1"]
    values = dict(line.rsplit(None, 1) for line in lines[1:] if ":" in line)
    assert values["Output token throughput (tok/s):"] == "2.50"
    assert values["Request goodput (req/s):"] == "0.50"
    assert values["Mean TTFT (ms):"] == "150.00"
    assert values["Median TPOT (ms):"] == "650.00"
    assert all(len(line) == 52 for line in lines)


def test_a_run_of_new_prompts_served_from_a_cache_is_warned_of():
    metrics = {**compute_metrics(RECORDS, 2.0), "total_cached_tokens": 24}
    last = format_report("pagoda", metrics, new_prompts=True).splitlines()[-1]
    assert last.startswith("warning: 24 of 30 prompt tokens came from the server's cache")
    assert not format_report("pagoda", metrics).splitlines()[-1].startswith("warning")
    cold = compute_metrics(RECORDS, 2.0)
    assert not format_report("pagoda", cold, new_prompts=True).splitlines()[-1].startswith("warning")


def test_json_has_metrics_records_and_no_nan(tmp_path):
    single = [RECORDS[0]]
    path = tmp_path / "out.json"
    write_json(path, {"seed": 0}, {"pagoda": (compute_metrics(single, 1.0), single)}, {"note": 1})
    document = json.loads(path.read_text())
    assert document["config"] == {"seed": 0} and document["note"] == 1
    run = document["runs"]["pagoda"]
    assert run["metrics"]["total_output_tokens"] == 3
    assert run["requests"][0]["tpot_s"] == pytest.approx(0.1)
    assert run["requests"][0]["chunk_times_s"] == [0.1, 0.2, 0.3]


def test_plots_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_plots(tmp_path / "plots", {"pagoda": RECORDS, "hf": RECORDS[:1]})
    assert [p.name for p in paths] == ["latency_cdf.png", "throughput.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
