"""bench/bench_control_plane.py: its smoke run prints a table that holds together, and its arithmetic is right."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
NUM = r"([\d.]+)"
# [tree] sched exec streams tok/s load-tok/s cpu/tok "us" steps/s cpu/step "ms" core idle "ms" step "ms"
# itl-p50 "ms" itl-p99 "ms" p99-steps tok/resp machine% exec-cpu load-cpu errors
ROW = re.compile(
    rf"^(A|B)?\s+(\d+)\s+(\d+)\s+(\d+)\s+{NUM}\s+{NUM}\s+{NUM} us\s+{NUM}\s+{NUM} ms\s+{NUM}\s+{NUM} ms\s+{NUM} ms\s+"
    rf"{NUM} ms\s+{NUM} ms\s+{NUM}\s+{NUM}\s+(\d+)%\s+{NUM}\s+{NUM}\s+(.*)$"
)
FIELDS = [
    "label",
    "sched",
    "exec",
    "streams",
    "tok_s",
    "load_tok_s",
    "cpu_per_token_us",
    "steps_s",
    "cpu_per_step_ms",
    "core",
    "idle_ms",
    "step_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_p99_steps",
    "tok_per_resp",
    "machine",
    "exec_cpu",
    "load_cpu",
    "errors",
]


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_control_plane", BENCH / "bench_control_plane.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_control_plane", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def smoke(tmp_path, *args):
    """The smoke run's rows (field name -> text) and its output; fails when it fails or a process logged a traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_control_plane.py"), "--smoke", "--log-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 scheduler x 2 executors" in done.stdout
    assert not [p for p in tmp_path.glob("*.log") if "Traceback" in p.read_text(errors="replace")]
    return [dict(zip(FIELDS, m.groups())) for m in map(ROW.match, done.stdout.splitlines()) if m], done.stdout


def assert_row_holds_together(row):
    tok_s, load_tok_s = float(row["tok_s"]), float(row["load_tok_s"])
    assert tok_s > 0 and float(row["steps_s"]) > 0 and float(row["cpu_per_step_ms"]) > 0
    assert float(row["cpu_per_token_us"]) > 0
    assert abs(load_tok_s - tok_s) <= 0.25 * tok_s  # the clients counted the tokens the schedulers did
    assert 0 < float(row["itl_p50_ms"]) <= float(row["itl_p99_ms"])
    assert float(row["itl_p99_steps"]) > 0
    assert float(row["tok_per_resp"]) >= 1.0
    assert row["errors"] == "-"  # no request failed


@pytest.mark.integration
@pytest.mark.parametrize("client", ["stub", "library", "sse"])
def test_smoke_run_prints_a_row_per_configuration(tmp_path, client):
    rows, out = smoke(tmp_path, "--client", client)
    assert [(r["label"], r["sched"], r["exec"]) for r in rows] == [(None, "1", "2"), (None, "2", "2")], out
    for row in rows:
        assert_row_holds_together(row)


@pytest.mark.integration
def test_smoke_run_with_a_baseline_prints_both_checkouts_and_their_ratio(tmp_path):
    rows, out = smoke(tmp_path, "--baseline", str(ROOT), "--streams", "6")
    assert [(r["label"], r["sched"], r["streams"]) for r in rows] == [(t, s, "6") for s in "12" for t in "AB"], out
    for row in rows:
        assert_row_holds_together(row)
    assert out.count("B/A  tok/s ") == 2
    assert [p.name for p in sorted(tmp_path.glob("scheduler-0-A*.log"))] == [
        "scheduler-0-A1x2x6.log",
        "scheduler-0-A2x2x6.log",
    ]


def test_partition_gives_each_scheduler_its_own_executors(bench):
    addresses = [f"a{i}" for i in range(5)]
    assert bench.groups_for(2, addresses, "partition") == [["a0", "a2", "a4"], ["a1", "a3"]]
    assert bench.groups_for(2, addresses[:1], "partition") is None
    assert bench.groups_for(2, addresses[:1], "shared") == [["a0"], ["a0"]]


def test_row_divides_the_window_deltas(bench):
    def snap(wall, sched, counters, machine):
        return bench.Snapshot(wall, sched, 0.0, 0.0, machine, counters)

    names = ("pagoda:generation_tokens_total",) + bench.EXECUTOR_COUNTERS
    a = snap(10.0, (1.0, 2.0), dict.fromkeys(names, 0.0), (0, 0))
    b = snap(12.0, (1.5, 3.0), dict(zip(names, (4000.0, 500.0, 1.0, 10.0))), (300, 400))
    gaps = bench.GapHistogram()
    for gap_s in [0.010] * 98 + [0.100] * 2:
        gaps.add(gap_s, 2)
    row = bench.row_of(2, 8, 64, a, b, bench.LoadReport(1990.0, gaps, {}))
    assert (row.tokens_per_s, row.steps_per_s, row.load_tokens_per_s) == (2000.0, 250.0, 1990.0)
    assert row.cpu_per_step_ms == pytest.approx(1.5 / 500 * 1e3)  # both schedulers' CPU over all steps
    assert row.cpu_per_token_us == pytest.approx(1.5 / 4000 * 1e6)  # ... and over all tokens
    assert row.scheduler_core == pytest.approx(0.5)  # the busier one: 1 s of CPU in 2 s
    assert (row.idle_per_step_ms, row.step_ms, row.machine_busy) == (2.0, 20.0, 0.75)
    assert row.itl_p50_ms == pytest.approx(10.0, rel=0.01)
    assert row.itl_p99_ms == pytest.approx(100.0, rel=0.01)  # the 99th of 100 gaps
    assert row.itl_p99_steps == pytest.approx(0.1 * 250 / 8, rel=0.01)  # each executor steps 31.25 times a second
    assert row.tokens_per_response == 2.0


def test_streams_are_shared_out_by_executors(bench):
    assert bench.streams_for(64, [["a0", "a2", "a4"], ["a1", "a3"]]) == [39, 25]
    assert bench.streams_for(5, [["a0"], ["a0"]]) == [3, 2]
    assert bench.stream_totals(bench.parse_args(["--streams", "64,256"]), 4) == [64, 256]
    assert bench.stream_totals(bench.parse_args(["--streams-per-executor", "16"]), 4) == [64]


def test_gap_percentiles_survive_merging_and_json(bench):
    gaps = [bench.GapHistogram(), bench.GapHistogram()]
    for i in range(1, 1001):
        gaps[i % 2].add(i * 1e-3, i % 3)
    merged = bench.GapHistogram.merged(bench.GapHistogram.from_json(g.to_json()) for g in gaps)
    assert merged.num_gaps == 1000
    assert merged.quantile(0.5) == pytest.approx(0.500, rel=0.006)
    assert merged.quantile(0.99) == pytest.approx(0.990, rel=0.006)
    assert merged.tokens_per_response() == pytest.approx(sum(i % 3 for i in range(1, 1001)) / 1000)


def test_sse_reader_decodes_chunks_and_events_across_splits(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from control_plane_sse import EventParser, read_body, read_head

    events = [b'{"choices": [{"text": " ab"}]}', b'{"choices": [{"text": "\\n\\n"}]}', b"[DONE]"]
    stream = b"".join(b"data: " + e + b"\n\n" for e in events)
    pieces = [stream[:7], stream[7:40], stream[40:]]  # chunk boundaries inside events and inside "data:"
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n" + body

    async def read():
        reader = asyncio.StreamReader()
        reader.feed_data(reply + b"HTTP/1.1 404 Not Found\r\n")  # the next reply on the connection stays unread
        status, headers = await read_head(reader)
        got = []
        reusable = await read_body(reader, headers, EventParser(got.append).feed)
        return status, reusable, got, await reader.readuntil(b"\r\n")

    status, reusable, got, rest = asyncio.run(read())
    assert (status, reusable, got, rest) == (200, True, events, b"HTTP/1.1 404 Not Found\r\n")
