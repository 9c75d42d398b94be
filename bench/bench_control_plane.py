"""Control-plane scale: real schedulers over 1, 4, 16 and 64 simulated executors.

Starts the simulated executors once (`pagoda-executor --simulate`: a step sleeps
the time the cost model fitted to SmolLM2-135M bf16 on this CPU gives it), then
for each configuration (executors x schedulers x streams) starts 1 or 2 real
schedulers over them and one load process per scheduler that keeps its share of
the streams in flight (--streams in all, a comma list for several
configurations; else --streams-per-executor per executor), through the client
that --client names: the generated gRPC stub (the default, the lightest client
process: a `Generate` call per stream), the project's asyncio client library
(`library`: its streams over one `GenerateStreams` call; `library-per-call`),
or OpenAI-compatible SSE over the schedulers' HTTP API. After a warm-up it measures, over the same window:

- aggregate output tokens/s (the schedulers' `generation_tokens` counters), and
  the same tokens as the clients counted them;
- scheduler CPU per generated token (µs) and per executor step (`/proc/<pid>/stat`
  of the schedulers over the tokens and the steps the executors ran);
- executor idle time per step (the executors' `idle_seconds`: time from
  finishing a step to receiving the next plan), next to the modelled step time;
- the inter-token latency the clients saw: p50 and p99 of the gap between two
  responses of a request (its first, the time to first token, left out), the
  p99 in executor step periods, and the mean tokens per response;
- how much of one core each scheduler used, and how busy the whole machine was.

The executors' tokenizer is byte-level by default (`--tokenizer`), as the default
model's and most served models' are; `--tokenizer word-level` makes the
scheduler detokenize by windows, as it does SentencePiece models.

Then it says where one scheduler saturates, and with --profile runs the largest
configuration once more with the scheduler under cProfile and prints its top costs.

Two schedulers: `--split partition` (the default) gives each scheduler its own
half of the executors (each executor driven by one scheduler, no lease needed);
`--split shared` gives both schedulers every executor, for schedulers that
share executors through leases (docs/durability.md section 3).

`--baseline PATH` names another checkout (a git worktree at another commit):
each configuration then runs twice, first with PATH's schedulers (row A, run
by PATH's .venv if it has one, else by this interpreter), then with this
tree's (row B), over the same executors and load, and a line gives B/A.

    .venv/bin/python bench/bench_control_plane.py                 # the table (a few minutes)
    .venv/bin/python bench/bench_control_plane.py --profile       # and the saturated scheduler's profile
    .venv/bin/python bench/bench_control_plane.py --smoke         # seconds: 2 executors, tiny load
    .venv/bin/python bench/bench_control_plane.py --executors 4 --schedulers 1 --streams 64,256,1024 \\
        --time-scale 0 --client sse --baseline ../pagoda-before
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from control_plane_clients import CLIENTS
from control_plane_gaps import GapHistogram
from control_plane_profile import print_profile
from control_plane_report import (
    EXECUTOR_COUNTERS,
    SCHEDULER_COUNTERS,
    LoadReport,
    Row,
    Snapshot,
    format_row,
    header,
    ratio_line,
    row_of,
    saturation,
)
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


def groups_for(num_schedulers: int, addresses: Sequence[str], split: str) -> list[list[str]] | None:
    """Executor addresses of each scheduler; None when a partition would leave one without any."""
    if split == "shared":
        return [list(addresses)] * num_schedulers
    if num_schedulers > len(addresses):
        return None
    return [list(addresses[i::num_schedulers]) for i in range(num_schedulers)]


def streams_for(total: int, groups: Sequence[Sequence[str]]) -> list[int]:
    """`total` streams shared out over the schedulers in proportion to their executors (the rest one each)."""
    sizes = [len(group) for group in groups]
    shares = [total * size // sum(sizes) for size in sizes]
    for i in range(total - sum(shares)):
        shares[i] += 1
    return shares


def stream_totals(args: argparse.Namespace, num_executors: int) -> list[int]:
    """The total streams of each configuration over `num_executors` executors."""
    if args.streams:
        return [int(n) for n in args.streams.split(",")]
    return [args.streams_per_executor * num_executors]


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


def start_loads(schedulers: Sequence[Proc], streams: Sequence[int], args: argparse.Namespace) -> list:
    """One load process per scheduler; returns once each has started."""
    loads = []
    for i, (proc, num_streams) in enumerate(zip(schedulers, streams)):
        target = proc.http_address if args.client == "sse" else proc.address
        argv = [sys.executable, str(LOAD_SCRIPT), "--target", target, "--streams", str(num_streams)]
        argv += ["--client", args.client, "--max-tokens", str(args.max_tokens), "--prompt-len", str(args.prompt_len)]
        argv += ["--seed", str(i), "--max-s", str(args.warmup_s + args.measure_s + 120)]
        loads.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for load in loads:
        readable, _, _ = select.select([load.stdout], [], [], 60)
        if not readable or load.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a load process did not start within 60 s (exit status {load.poll()})")
    return loads


def tell_loads(loads: Sequence[subprocess.Popen], line: str) -> None:
    """Send each load a line ("mark": the window opens, "end": it closes); one already gone is left to `stop_loads`."""
    for load in loads:
        try:
            load.stdin.write(line + "\n")
            load.stdin.flush()
        except BrokenPipeError:
            pass


def stop_loads(loads: Sequence[subprocess.Popen]) -> LoadReport:
    """Close each load's stdin (it stops), read its report; returns their windows added up."""
    errors: dict[str, int] = {}
    tokens_per_s = 0.0
    gaps = []
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
        window = report["window"]
        tokens_per_s += window["tokens"] / window["s"] if window["s"] > 0 else 0.0
        gaps.append(GapHistogram.from_json(window["gaps"]))
    return LoadReport(tokens_per_s, GapHistogram.merged(gaps), errors)


def signal_all(procs: Sequence[Proc], sig: signal.Signals | None) -> None:
    """Send `sig` to each process (None: nothing to send)."""
    for proc in procs if sig is not None else ():
        os.kill(proc.pid, sig)


def run_config(
    num_schedulers: int,
    executors: Sequence[Proc],
    total_streams: int,
    args: argparse.Namespace,
    log_dir: Path,
    profile_dir: Path | None = None,
    checkout: Path | None = None,
    label: str = "",
) -> Row | None:
    """Start the schedulers (`checkout`'s, else this tree's) and the load, measure one window, stop them.

    Returns None if the split cannot run it; the row carries `label`.
    """
    groups = groups_for(num_schedulers, [p.address for p in executors], args.split)
    if groups is None:
        return None
    tag = f"{label}{num_schedulers}x{len(executors)}x{total_streams}" + ("-profile" if profile_dir else "")
    http = args.client == "sse"
    schedulers = start_schedulers(groups, log_dir, tag, profile_dir=profile_dir, http=http, checkout=checkout)
    streams = streams_for(total_streams, groups)
    loads: list[subprocess.Popen] = []
    try:
        loads = start_loads(schedulers, streams, args)
        time.sleep(args.warmup_s)
        signal_all(schedulers, signal.SIGUSR1 if profile_dir else None)
        tell_loads(loads, "mark")
        before = snapshot(schedulers, executors, loads)
        time.sleep(args.measure_s)
        after = snapshot(schedulers, executors, loads)
        tell_loads(loads, "end")
        signal_all(schedulers, signal.SIGUSR2 if profile_dir else None)
        report = stop_loads(loads)
        if profile_dir:
            expected = [profile_dir / f"{p.name}.prof" for p in schedulers]
            wait_until(lambda: all(path.exists() for path in expected), 60, "the schedulers' profiles", schedulers)
    finally:
        for load in loads:
            if load.poll() is None:
                load.kill()
                load.wait(timeout=10)
        stop(schedulers)
    row = row_of(num_schedulers, len(executors), sum(streams), before, after, report)
    return dataclasses.replace(row, label=label)


def run_table(executors: Sequence[Proc], args: argparse.Namespace, log_dir: Path) -> list[Row]:
    """Every configuration (with --baseline: twice, A then B, and their ratio), printed as it ends."""
    rows = []
    print(header(labelled=args.baseline is not None), flush=True)
    for num_executors in [int(n) for n in args.executors.split(",")]:
        for num_schedulers in [int(n) for n in args.schedulers.split(",")]:
            for total in stream_totals(args, num_executors):
                pair = [
                    run_config(num_schedulers, executors[:num_executors], total, args, log_dir, None, checkout, label)
                    for checkout, label in ([(args.baseline, "A"), (None, "B")] if args.baseline else [(None, "")])
                ]
                if pair[0] is None:
                    print(f"{num_schedulers:>5} {num_executors:>5}  (skipped: a partition needs an executor each)")
                    continue
                for row in pair:
                    print(format_row(row), flush=True)
                if len(pair) == 2:
                    print(ratio_line(*pair), flush=True)
                rows += pair
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executors", default="1,4,16,64", help="simulated executor counts")
    parser.add_argument("--schedulers", default="1,2", help="scheduler counts")
    parser.add_argument("--split", choices=("partition", "shared"), default="partition")
    parser.add_argument("--streams", help="total concurrent streams per configuration, a comma list of counts")
    parser.add_argument("--streams-per-executor", type=int, default=16, help="without --streams")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="stub", help="what the load streams through")
    parser.add_argument("--baseline", type=Path, help="another checkout whose schedulers run each configuration too")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="executors' --simulate-time-scale")
    parser.add_argument(
        "--tokenizer",
        choices=("byte-level", "word-level"),
        default="byte-level",
        help="executors' --simulate-tokenizer: byte-level as the default model's (SmolLM2), Llama 3's and Qwen's; "
        "word-level to detokenize by windows as SentencePiece models are",
    )
    parser.add_argument("--profile", action="store_true", help="profile one scheduler over the most executors")
    parser.add_argument("--log-dir", help="keep the processes' logs here (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="2 executors, 1 and 2 schedulers, a tiny load")
    args = parser.parse_args(argv)
    if args.smoke:
        args.executors, args.schedulers, args.streams_per_executor = "2", "1,2", 4
        args.max_tokens, args.warmup_s, args.measure_s = 16, 1.0, 2.0
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        if not (args.baseline / "scheduler_svc").is_dir():
            parser.error(f"--baseline {args.baseline}: no scheduler_svc there (not a checkout of this project)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    stop_on_signals()
    num_executors = max(int(n) for n in args.executors.split(","))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        executor_args = ["--simulate-time-scale", str(args.time_scale), "--simulate-tokenizer", args.tokenizer]
        executors = start_executors(num_executors, log_dir, executor_args)
        print(
            f"{num_executors} simulated executors ({args.tokenizer} tokenizer) serving after "
            f"{time.monotonic() - started:.1f} s",
            flush=True,
        )
        try:
            rows = run_table(executors, args, log_dir)
            print("\n" + "\n".join(saturation(rows)))
            if args.profile:
                profile_dir = log_dir / "profile"
                profile_dir.mkdir(exist_ok=True)
                run_config(1, executors, stream_totals(args, num_executors)[-1], args, log_dir, profile_dir)
                print_profile(profile_dir)
        finally:
            stop(executors)
    if any(r.errors for r in rows):
        sys.exit("some requests failed (see the errors column)")


if __name__ == "__main__":
    main()
