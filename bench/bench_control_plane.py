"""Control-plane scale: real schedulers over 1, 4, 16 and 64 simulated executors.

Starts the simulated executors once (`pagoda-executor --simulate`: a step sleeps
the time the cost model fitted to SmolLM2-135M bf16 on this CPU gives it), then
for each configuration starts 1 or 2 real schedulers over them and one load
process per scheduler that keeps --streams-per-executor streams per executor in
flight. After a warm-up it measures, over the same window:

- aggregate output tokens/s (the schedulers' `generation_tokens` counters);
- scheduler CPU per executor step (`/proc/<pid>/stat` of the schedulers over
  the steps the executors ran, from their `steps` counters);
- executor idle time per step (the executors' `idle_seconds`: time from
  finishing a step to receiving the next plan), next to the modelled step time;
- how much of one core each scheduler used, and how busy the whole machine was.

Then it says where one scheduler saturates, and with --profile runs the largest
configuration once more with the scheduler under cProfile and prints its top costs.

Two schedulers: `--split partition` (the default) gives each scheduler its own
half of the executors (each executor driven by one scheduler, no lease needed);
`--split shared` gives both schedulers every executor, for schedulers that
share executors through leases (docs/durability.md section 3).

    .venv/bin/python bench/bench_control_plane.py                 # the table (a few minutes)
    .venv/bin/python bench/bench_control_plane.py --profile       # and the saturated scheduler's profile
    .venv/bin/python bench/bench_control_plane.py --smoke         # seconds: 2 executors, tiny load
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pstats
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from control_plane_profile import by_kind
from control_plane_system import (
    Proc,
    cpu_seconds,
    machine_jiffies,
    scrape_sum,
    start_executors,
    start_schedulers,
    stop,
    wait_until,
)
from stop_signals import stop_on_signals

LOAD_SCRIPT = Path(__file__).with_name("control_plane_load.py")
SCHEDULER_COUNTERS = ("pagoda:generation_tokens_total",)
EXECUTOR_COUNTERS = (
    "pagoda_executor_steps_total",
    "pagoda_executor_idle_seconds_sum",
    "pagoda_executor_step_seconds_sum",
)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Counters of one configuration at one instant."""

    wall_s: float
    scheduler_cpu_s: tuple[float, ...]
    executors_cpu_s: float
    loads_cpu_s: float
    machine: tuple[int, int]
    counters: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table."""

    num_schedulers: int
    num_executors: int
    streams: int
    tokens_per_s: float
    steps_per_s: float
    cpu_per_step_ms: float  # scheduler CPU (all schedulers) per executor step
    scheduler_core: float  # the busiest scheduler's CPU seconds per second
    idle_per_step_ms: float
    step_ms: float  # inside the executor: the modelled step plus the servicer's own work
    machine_busy: float  # fraction of the whole machine's CPU time in use (every process, every user)
    executors_cpu: float  # cores used by all executors together
    load_cpu: float  # cores used by the load processes
    errors: dict[str, int]


def groups_for(num_schedulers: int, addresses: Sequence[str], split: str) -> list[list[str]] | None:
    """Executor addresses of each scheduler; None when a partition would leave one without any."""
    if split == "shared":
        return [list(addresses)] * num_schedulers
    if num_schedulers > len(addresses):
        return None
    return [list(addresses[i::num_schedulers]) for i in range(num_schedulers)]


def snapshot(schedulers: Sequence[Proc], executors: Sequence[Proc], loads: Sequence[subprocess.Popen]) -> Snapshot:
    """Counters and CPU times now."""
    counters = scrape_sum(schedulers, SCHEDULER_COUNTERS) | scrape_sum(executors, EXECUTOR_COUNTERS)
    return Snapshot(
        wall_s=time.monotonic(),
        scheduler_cpu_s=tuple(cpu_seconds(p.pid) for p in schedulers),
        executors_cpu_s=sum(cpu_seconds(p.pid) for p in executors),
        loads_cpu_s=sum(cpu_seconds(p.pid) for p in loads),
        machine=machine_jiffies(),
        counters=counters,
    )


def row_of(num_schedulers: int, executors: int, streams: int, a: Snapshot, b: Snapshot, errors) -> Row:
    """The table line for the window between snapshots `a` and `b`."""
    wall = b.wall_s - a.wall_s
    delta = {name: b.counters[name] - a.counters[name] for name in b.counters}
    steps = max(delta["pagoda_executor_steps_total"], 1.0)
    scheduler_cpu = [after - before for before, after in zip(a.scheduler_cpu_s, b.scheduler_cpu_s)]
    busy, total = (after - before for before, after in zip(a.machine, b.machine))
    return Row(
        num_schedulers=num_schedulers,
        num_executors=executors,
        streams=streams,
        tokens_per_s=delta["pagoda:generation_tokens_total"] / wall,
        steps_per_s=steps / wall,
        cpu_per_step_ms=sum(scheduler_cpu) / steps * 1e3,
        scheduler_core=max(scheduler_cpu) / wall,
        idle_per_step_ms=delta["pagoda_executor_idle_seconds_sum"] / steps * 1e3,
        step_ms=delta["pagoda_executor_step_seconds_sum"] / steps * 1e3,
        machine_busy=busy / max(total, 1),
        executors_cpu=(b.executors_cpu_s - a.executors_cpu_s) / wall,
        load_cpu=(b.loads_cpu_s - a.loads_cpu_s) / wall,
        errors=errors,
    )


def start_loads(schedulers: Sequence[Proc], streams: Sequence[int], args: argparse.Namespace) -> list:
    """One load process per scheduler; returns once each has started."""
    loads = []
    for i, (proc, num_streams) in enumerate(zip(schedulers, streams)):
        argv = [sys.executable, str(LOAD_SCRIPT), "--target", proc.address, "--streams", str(num_streams)]
        argv += ["--max-tokens", str(args.max_tokens), "--prompt-len", str(args.prompt_len), "--seed", str(i)]
        argv += ["--max-s", str(args.warmup_s + args.measure_s + 120)]
        loads.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for load in loads:
        readable, _, _ = select.select([load.stdout], [], [], 60)
        if not readable or load.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a load process did not start within 60 s (exit status {load.poll()})")
    return loads


def stop_loads(loads: Sequence[subprocess.Popen]) -> dict[str, int]:
    """Close each load's stdin (it stops), read its report; returns the errors of all, by status."""
    errors: dict[str, int] = {}
    for load in loads:
        try:
            out, _ = load.communicate(input="", timeout=30)
            report = json.loads(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as exc:
            load.kill()
            load.wait(timeout=10)
            errors[f"load process: {type(exc).__name__}"] = 1
            continue
        for status, count in report["errors"].items():
            errors[status] = errors.get(status, 0) + count
    return errors


def signal_all(procs: Sequence[Proc], sig: signal.Signals | None) -> None:
    """Send `sig` to each process (None: nothing to send)."""
    for proc in procs if sig is not None else ():
        os.kill(proc.pid, sig)


def run_config(num_schedulers: int, executors: Sequence[Proc], args, log_dir: Path, profile_dir=None) -> Row | None:
    """Start the schedulers and the load, measure one window, stop them; None if the split cannot run it."""
    groups = groups_for(num_schedulers, [p.address for p in executors], args.split)
    if groups is None:
        return None
    tag = f"{num_schedulers}x{len(executors)}" + ("-profile" if profile_dir else "")
    schedulers = start_schedulers(groups, log_dir, tag, profile_dir=profile_dir)
    streams = [args.streams_per_executor * len(executors) // num_schedulers] * num_schedulers
    if args.split == "partition":
        streams = [args.streams_per_executor * len(group) for group in groups]
    loads: list[subprocess.Popen] = []
    try:
        loads = start_loads(schedulers, streams, args)
        time.sleep(args.warmup_s)
        signal_all(schedulers, signal.SIGUSR1 if profile_dir else None)
        before = snapshot(schedulers, executors, loads)
        time.sleep(args.measure_s)
        after = snapshot(schedulers, executors, loads)
        signal_all(schedulers, signal.SIGUSR2 if profile_dir else None)
        errors = stop_loads(loads)
        if profile_dir:
            expected = [profile_dir / f"{p.name}.prof" for p in schedulers]
            wait_until(lambda: all(path.exists() for path in expected), 60, "the schedulers' profiles", schedulers)
    finally:
        for load in loads:
            if load.poll() is None:
                load.kill()
                load.wait(timeout=10)
        stop(schedulers)
    return row_of(num_schedulers, len(executors), sum(streams), before, after, errors)


HEADER = (
    f"{'sched':>5} {'exec':>5} {'streams':>7} {'tok/s':>8} {'steps/s':>8} {'sched CPU/step':>14} "
    f"{'sched core':>10} {'idle/step':>10} {'step':>8} {'machine':>8} {'exec CPU':>8} {'load CPU':>8}  errors"
)


def format_row(r: Row) -> str:
    """One table line (times in ms, CPU in cores)."""
    return (
        f"{r.num_schedulers:>5} {r.num_executors:>5} {r.streams:>7} {r.tokens_per_s:>8.0f} {r.steps_per_s:>8.0f} "
        f"{r.cpu_per_step_ms:>11.3f} ms {r.scheduler_core:>10.2f} {r.idle_per_step_ms:>7.2f} ms "
        f"{r.step_ms:>5.1f} ms {r.machine_busy * 100:>7.0f}% {r.executors_cpu:>8.2f} {r.load_cpu:>8.2f}  "
        f"{r.errors or '-'}"
    )


def saturation(rows: Sequence[Row]) -> list[str]:
    """In words: how many executors one scheduler's core can drive, and what limited each run."""
    lines = []
    for r in (r for r in rows if r.num_schedulers == 1):
        steps_per_core_s = 1e3 / r.cpu_per_step_ms if r.cpu_per_step_ms > 0 else float("inf")
        starved = r.idle_per_step_ms > 0.25 * r.step_ms
        limit = "the scheduler's core" if r.scheduler_core >= 0.85 else f"the machine ({r.machine_busy:.0%} busy)"
        lines.append(
            f"1 scheduler x {r.num_executors} executors: {r.cpu_per_step_ms:.2f} ms of scheduler CPU per step, so one "
            f"core drives at most {steps_per_core_s:.0f} steps/s = {steps_per_core_s * r.step_ms / 1e3:.1f} executors "
            f"stepping every {r.step_ms:.1f} ms; it used {r.scheduler_core:.2f} of a core and executors waited "
            f"{r.idle_per_step_ms:.1f} ms per step for a plan" + (f": saturated, limited by {limit}" if starved else "")
        )
    return lines


def print_profile(profile_dir: Path, top: int = 20) -> None:
    """Each profiled scheduler's time by kind of work, then its top functions by own time."""
    for path in sorted(profile_dir.glob("*.prof")):
        stats = pstats.Stats(str(path))
        total = stats.total_tt  # type: ignore[attr-defined]
        print(f"\n== {path.stem}: {total:.1f} s of CPU in the loop's thread in the window, by kind of work (own time)")
        for kind, seconds in by_kind(stats):
            print(f"{seconds / total * 100:5.1f}%  {kind}")
        print(f"-- top {top} functions by own time")
        entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
        for (file, line, name), (_, calls, own_s, cum_s, _) in entries[:top]:
            where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
            print(f"{own_s / total * 100:5.1f}% own {cum_s:7.2f} s cum {calls:>9} calls  {name}  ({where})")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executors", default="1,4,16,64", help="simulated executor counts")
    parser.add_argument("--schedulers", default="1,2", help="scheduler counts")
    parser.add_argument("--split", choices=("partition", "shared"), default="partition")
    parser.add_argument("--streams-per-executor", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="executors' --simulate-time-scale")
    parser.add_argument("--profile", action="store_true", help="profile one scheduler over the most executors")
    parser.add_argument("--log-dir", help="keep the processes' logs here (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="2 executors, 1 and 2 schedulers, a tiny load")
    args = parser.parse_args(argv)
    if args.smoke:
        args.executors, args.schedulers, args.streams_per_executor = "2", "1,2", 4
        args.max_tokens, args.warmup_s, args.measure_s = 16, 1.0, 2.0
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    stop_on_signals()
    counts = [int(n) for n in args.executors.split(",")]
    scheduler_counts = [int(n) for n in args.schedulers.split(",")]
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        executors = start_executors(max(counts), log_dir, ["--simulate-time-scale", str(args.time_scale)])
        print(f"{max(counts)} simulated executors serving after {time.monotonic() - started:.1f} s", flush=True)
        rows = []
        try:
            print(HEADER, flush=True)
            for num_executors in counts:
                for num_schedulers in scheduler_counts:
                    row = run_config(num_schedulers, executors[:num_executors], args, log_dir)
                    if row is None:
                        print(f"{num_schedulers:>5} {num_executors:>5}  (skipped: a partition needs an executor each)")
                        continue
                    rows.append(row)
                    print(format_row(row), flush=True)
            print("\n" + "\n".join(saturation(rows)))
            if args.profile:
                profile_dir = log_dir / "profile"
                profile_dir.mkdir(exist_ok=True)
                run_config(1, executors, args, log_dir, profile_dir)
                print_profile(profile_dir)
        finally:
            stop(executors)
    if any(r.errors for r in rows):
        sys.exit("some requests failed (see the errors column)")


if __name__ == "__main__":
    main()
