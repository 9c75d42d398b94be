"""A scheduler under cProfile for a chosen window, and its profile by kind of work.

    python bench/control_plane_profile.py OUT.prof [pagoda-scheduler flags...]

runs `pagoda-scheduler` with the given flags; SIGUSR1 starts profiling its main
thread (the event loop: every request, step and stream of the scheduler runs
there) in CPU time, SIGUSR2 stops and writes OUT.prof. So the benchmark profiles only its
measurement window, not start-up. `by_kind` sorts a profile's own time into
the kinds of work a scheduler does; `print_profile` prints the profiles of a folder that way.
"""

from __future__ import annotations

import cProfile
import pstats
import signal
import sys
import time
from pathlib import Path

# (kind, substrings of "file:function" that belong to it), first match wins.
KINDS = (
    ("gRPC I/O (Cython core, stream writes, polling)", ("grpc", "_contextvars.Context", "select.epoll", "selectors")),
    ("proto conversion", ("step_pb", "params_pb", "client_pb_convert", "_pb2", "protobuf")),
    ("detokenize + stop strings", ("detokenizer", "tokenizers.Tokenizer", "stop_checker", "tokenizer.py")),
    ("request streams (engine, outputs)", ("engine.py", "output_processor", "server.py", "request.py")),
    ("scheduling + KV blocks", ("scheduler.py", "block_pool", "kv_cache_manager", "sequence.py", "step_builder")),
    ("executor handles", ("executor_handle",)),
    ("metrics", ("prometheus_client", "metrics.py")),
    ("logging", ("structlog", "logging")),
    ("asyncio machinery", ("asyncio", "events.py", "tasks.py", "queues.py")),
)


def by_kind(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Own (not cumulative) seconds per kind of work, largest first; the rest is "other"."""
    totals: dict[str, float] = {}
    for (file, _, name), (_, _, own_s, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{file}:{name}"
        kind = next((k for k, keys in KINDS if any(key in where for key in keys)), "other")
        totals[kind] = totals.get(kind, 0.0) + own_s
    return sorted(totals.items(), key=lambda kv: kv[1], reverse=True)


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


def main() -> None:
    out = Path(sys.argv[1])
    profiler = cProfile.Profile(time.thread_time)  # CPU time of the loop's thread: waits for a core do not count

    def stop(*_: object) -> None:
        profiler.disable()
        profiler.dump_stats(str(out))

    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, stop)
    from scheduler_svc.main import main as scheduler_main

    scheduler_main(sys.argv[2:])


if __name__ == "__main__":
    main()
