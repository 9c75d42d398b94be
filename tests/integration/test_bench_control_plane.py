"""bench/bench_control_plane.py: its smoke run prints a table that holds together, and its arithmetic is right."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# sched exec streams tok/s steps/s cpu "ms" core idle "ms" step "ms" machine% exec-cpu load-cpu errors
ROW = re.compile(
    r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) ms\s+([\d.]+)\s+([\d.]+) ms\s+([\d.]+) ms\s+"
    r"(\d+)%\s+([\d.]+)\s+([\d.]+)\s+(.*)$"
)


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_control_plane", BENCH / "bench_control_plane.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_control_plane", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_smoke_run_prints_a_row_per_configuration(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_control_plane.py"), "--smoke", "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [m.groups() for m in map(ROW.match, done.stdout.splitlines()) if m]
    assert [(r[0], r[1]) for r in rows] == [("1", "2"), ("2", "2")], done.stdout
    for row in rows:
        tokens_per_s, steps_per_s, cpu_per_step_ms = float(row[3]), float(row[4]), float(row[5])
        assert tokens_per_s > 0 and steps_per_s > 0 and cpu_per_step_ms > 0
        assert row[12] == "-"  # no request failed
    assert "1 scheduler x 2 executors" in done.stdout
    assert not [p for p in tmp_path.glob("*.log") if "Traceback" in p.read_text(errors="replace")]


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
    row = bench.row_of(2, 8, 64, a, b, {})
    assert (row.tokens_per_s, row.steps_per_s) == (2000.0, 250.0)
    assert row.cpu_per_step_ms == pytest.approx(1.5 / 500 * 1e3)  # both schedulers' CPU over all steps
    assert row.scheduler_core == pytest.approx(0.5)  # the busier one: 1 s of CPU in 2 s
    assert (row.idle_per_step_ms, row.step_ms, row.machine_busy) == (2.0, 20.0, 0.75)
