"""What one configuration of the control-plane benchmark measured, and the table that shows it.

A `Row` is the arithmetic over one measurement window: the difference of two
`Snapshot`s of the schedulers' and executors' counters and CPU times, and the
`LoadReport` of what the load processes saw in the same window.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from control_plane_gaps import GapHistogram

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
class LoadReport:
    """The load processes' window, added up over them."""

    tokens_per_s: float  # tokens the clients received (each load's window tokens over its window)
    gaps: GapHistogram  # inter-token gaps of all loads' streams
    errors: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table."""

    num_schedulers: int
    num_executors: int
    streams: int
    tokens_per_s: float  # the schedulers' generation_tokens counters
    load_tokens_per_s: float  # the same tokens, counted by the clients
    cpu_per_token_us: float  # scheduler CPU (all schedulers) per generated token
    steps_per_s: float
    cpu_per_step_ms: float  # scheduler CPU (all schedulers) per executor step
    scheduler_core: float  # the busiest scheduler's CPU seconds per second
    idle_per_step_ms: float
    step_ms: float  # inside the executor: the modelled step plus the servicer's own work
    itl_p50_ms: float  # client-observed gap between a request's token-carrying responses
    itl_p99_ms: float
    itl_p99_steps: float  # the p99 gap in mean executor step periods (1 / each executor's steps/s)
    tokens_per_response: float  # mean tokens of the responses that ended a gap
    machine_busy: float  # fraction of the whole machine's CPU time in use (every process, every user)
    executors_cpu: float  # cores used by all executors together
    load_cpu: float  # cores used by the load processes
    errors: dict[str, int]
    label: str = ""  # which checkout's schedulers ran it, with --baseline: "A" (the baseline) or "B" (this tree)


def row_of(num_schedulers: int, executors: int, streams: int, a: Snapshot, b: Snapshot, loads: LoadReport) -> Row:
    """The table line for the window between snapshots `a` and `b`."""
    wall = b.wall_s - a.wall_s
    delta = {name: b.counters[name] - a.counters[name] for name in b.counters}
    steps = max(delta["pagoda_executor_steps_total"], 1.0)
    tokens = delta["pagoda:generation_tokens_total"]
    scheduler_cpu = [after - before for before, after in zip(a.scheduler_cpu_s, b.scheduler_cpu_s)]
    busy, total = (after - before for before, after in zip(a.machine, b.machine))
    itl_p99_s = loads.gaps.quantile(0.99)
    return Row(
        num_schedulers=num_schedulers,
        num_executors=executors,
        streams=streams,
        tokens_per_s=tokens / wall,
        load_tokens_per_s=loads.tokens_per_s,
        cpu_per_token_us=sum(scheduler_cpu) / tokens * 1e6 if tokens else math.nan,
        steps_per_s=steps / wall,
        cpu_per_step_ms=sum(scheduler_cpu) / steps * 1e3,
        scheduler_core=max(scheduler_cpu) / wall,
        idle_per_step_ms=delta["pagoda_executor_idle_seconds_sum"] / steps * 1e3,
        step_ms=delta["pagoda_executor_step_seconds_sum"] / steps * 1e3,
        itl_p50_ms=loads.gaps.quantile(0.5) * 1e3,
        itl_p99_ms=itl_p99_s * 1e3,
        itl_p99_steps=itl_p99_s * (steps / wall) / executors,
        tokens_per_response=loads.gaps.tokens_per_response(),
        machine_busy=busy / max(total, 1),
        executors_cpu=(b.executors_cpu_s - a.executors_cpu_s) / wall,
        load_cpu=(b.loads_cpu_s - a.loads_cpu_s) / wall,
        errors=loads.errors,
    )


def header(labelled: bool = False) -> str:
    """The table's header (with a first column naming the checkout when rows are `labelled`)."""
    return ("tree " if labelled else "") + (
        f"{'sched':>5} {'exec':>5} {'streams':>7} {'tok/s':>8} {'load tok/s':>10} {'CPU/tok':>10} {'steps/s':>8} "
        f"{'sched CPU/step':>14} {'sched core':>10} {'idle/step':>10} {'step':>8} {'ITL p50':>9} {'ITL p99':>9} "
        f"{'p99 steps':>9} {'tok/resp':>8} {'machine':>8} {'exec CPU':>8} {'load CPU':>8}  errors"
    )


def format_row(r: Row) -> str:
    """One table line (times in ms, CPU per token in µs, CPU in cores)."""
    return (f"{r.label:<4} " if r.label else "") + (
        f"{r.num_schedulers:>5} {r.num_executors:>5} {r.streams:>7} {r.tokens_per_s:>8.0f} "
        f"{r.load_tokens_per_s:>10.0f} {r.cpu_per_token_us:>7.1f} us {r.steps_per_s:>8.0f} "
        f"{r.cpu_per_step_ms:>11.3f} ms {r.scheduler_core:>10.2f} {r.idle_per_step_ms:>7.2f} ms {r.step_ms:>5.1f} ms "
        f"{r.itl_p50_ms:>6.2f} ms {r.itl_p99_ms:>6.2f} ms {r.itl_p99_steps:>9.2f} {r.tokens_per_response:>8.2f} "
        f"{r.machine_busy * 100:>7.0f}% {r.executors_cpu:>8.2f} {r.load_cpu:>8.2f}  {r.errors or '-'}"
    )


def ratio_line(a: Row, b: Row) -> str:
    """How checkout B's row compares with A's (> 1: B has more)."""
    return (
        f"B/A  tok/s {_ratio(b.tokens_per_s, a.tokens_per_s):.3f}, scheduler CPU per token "
        f"{_ratio(b.cpu_per_token_us, a.cpu_per_token_us):.3f}, ITL p99 {_ratio(b.itl_p99_ms, a.itl_p99_ms):.3f}"
    )


def _ratio(b: float, a: float) -> float:
    return b / a if a else math.nan


def saturation(rows: Sequence[Row]) -> list[str]:
    """In words: how many executors one scheduler's core can drive, and what limited each run."""
    lines = []
    for r in (r for r in rows if r.num_schedulers == 1):
        steps_per_core_s = 1e3 / r.cpu_per_step_ms if r.cpu_per_step_ms > 0 else float("inf")
        starved = r.idle_per_step_ms > 0.25 * r.step_ms
        limit = "the scheduler's core" if r.scheduler_core >= 0.85 else f"the machine ({r.machine_busy:.0%} busy)"
        lines.append(
            (f"{r.label}: " if r.label else "")
            + f"1 scheduler x {r.num_executors} executors, {r.streams} streams: {r.cpu_per_step_ms:.2f} ms of "
            f"scheduler CPU per step, so one core drives at most {steps_per_core_s:.0f} steps/s = "
            f"{steps_per_core_s * r.step_ms / 1e3:.1f} executors stepping every {r.step_ms:.1f} ms; it used "
            f"{r.scheduler_core:.2f} of a core and executors waited {r.idle_per_step_ms:.1f} ms per step for a plan"
            + (f": saturated, limited by {limit}" if starved else "")
        )
    return lines
