"""``pagoda serve``: run the local launcher in the foreground.

The ``pagoda`` command (``pagoda_client.cli``) adds these flags to its ``serve``
subcommand and calls ``cmd_serve``; the launcher is imported only then.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from pagoda.launch.serve_flags import add_serve_flags, passthrough

if TYPE_CHECKING:
    from pagoda.launch.commands import OffloadPlan
    from pagoda.launch.launcher import Launcher


class _Interrupted(BaseException):
    """SIGINT/SIGTERM while starting up."""


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """For ``serve``, split ``argv`` at ``--``: the rest goes to the scheduler."""
    argv = list(argv)
    if argv[:1] == ["serve"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def add_serve_arguments(parser: argparse.ArgumentParser, service_flags: bool = True) -> None:
    """The flags of ``pagoda serve``: the launcher's own, then (with `service_flags`) the services' it passes
    through (``pagoda.launch.serve_flags``, which imports the services' configs); unknown ``--flags`` go to the
    scheduler."""
    parser.add_argument("--executors", type=int, default=1, help="number of executor processes")
    parser.add_argument("--schedulers", type=int, default=1, help="number of schedulers, on ports from --port up")
    parser.add_argument("--port", type=int, default=50051, help="first scheduler's (client API) port")
    parser.add_argument("--host", default="127.0.0.1", help="scheduler bind address")
    offload = parser.add_argument_group("KV offload tier (docs/kv-offload.md; on by default)")
    offload.add_argument(
        "--kv-offload-dir",
        default=None,
        help="executor i keeps its tier in DIR/executor-<i>, across restarts "
        "(default: $PAGODA_CACHE_DIR or ~/.cache/pagoda, then kv-offload; '' = no disk tier)",
    )
    offload.add_argument("--kv-offload-size", default=None, help="disk tier capacity per executor (default 10GiB)")
    offload.add_argument("--kv-offload-memory", default=None, help="host-memory tier per executor (default none)")
    parser.add_argument("--metrics-port", type=int, default=None, help="scheduler Prometheus port")
    parser.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port")
    parser.add_argument("--executor-args", default="", help="extra executor flags, one quoted string")
    parser.add_argument(
        "--startup-timeout-s", type=float, default=900.0, help="how long the start waits for every child's health"
    )
    parser.add_argument("--log-dir", default=None, help="write child logs here instead of the terminal")
    parser.add_argument("--stop-grace-s", type=float, default=35.0, help="drain time per group on Ctrl-C/SIGTERM")
    supervision = parser.add_argument_group("supervision (a child that exits is restarted on its port)")
    supervision.add_argument("--no-restart", action="store_true", help="stop everything when a child exits")
    supervision.add_argument("--restart-backoff-s", type=float, default=1.0, help="first delay; doubles per restart")
    supervision.add_argument("--restart-backoff-max-s", type=float, default=30.0, help="longest delay")
    supervision.add_argument("--crash-loop-exits", type=int, default=5, help="this many exits of one child ...")
    supervision.add_argument("--crash-loop-window-s", type=float, default=60.0, help="... in this time stop all")
    if service_flags:
        add_serve_flags(parser)


def launcher_from_args(args: argparse.Namespace, scheduler_passthrough: Sequence[str]) -> Launcher:
    """A ``Launcher`` configured by the ``serve`` flags."""
    from pagoda.launch.launcher import Launcher
    from pagoda.launch.restart_policy import RestartPolicy

    policy = RestartPolicy(
        initial_backoff_s=args.restart_backoff_s,
        max_backoff_s=args.restart_backoff_max_s,
        crash_loop_exits=args.crash_loop_exits,
        crash_loop_window_s=args.crash_loop_window_s,
    )
    return Launcher(
        args.model,
        num_executors=args.executors,
        num_schedulers=args.schedulers,
        port=args.port,
        host=args.host,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        extra_executor_args=passthrough(args, "executor") + shlex.split(args.executor_args),
        extra_scheduler_args=passthrough(args, "scheduler") + list(scheduler_passthrough),
        log_dir=args.log_dir,
        startup_timeout_s=args.startup_timeout_s,
        stop_grace_s=args.stop_grace_s,
        restart=not args.no_restart,
        restart_policy=policy,
        kv_offload=offload_plan(args),
    )


def offload_plan(args: argparse.Namespace) -> OffloadPlan | None:
    """The tiers the ``serve`` flags ask for: the default root under the cache dir unless ``--kv-offload-dir``
    names one ('' with no ``--kv-offload-memory``: no tier); none by default for executor groups."""
    from pagoda.launch.commands import OffloadPlan

    group = int(getattr(args, "tensor_parallel_size", None) or 1) * int(
        getattr(args, "pipeline_parallel_size", None) or 1
    )
    if args.kv_offload_dir is None and group > 1:  # executor groups keep no tier yet (docs/parallel.md)
        return None
    if args.kv_offload_dir is None:
        return OffloadPlan(str(default_offload_root()), args.kv_offload_size, args.kv_offload_memory, next_free=True)
    if not args.kv_offload_dir and not args.kv_offload_memory:
        return None
    return OffloadPlan(args.kv_offload_dir, args.kv_offload_size, args.kv_offload_memory)


def default_offload_root() -> Path:
    """``$PAGODA_CACHE_DIR/kv-offload``, or ``~/.cache/pagoda/kv-offload`` (beside the default model)."""
    configured = os.environ.get("PAGODA_CACHE_DIR")
    cache = Path(configured).expanduser() if configured else Path.home() / ".cache" / "pagoda"
    return cache / "kv-offload"


def _pagoda_command() -> str:
    """`pagoda` if it is on PATH, else its path next to this interpreter (a venv not activated)."""
    beside = Path(sys.executable).parent / "pagoda"
    if shutil.which("pagoda") == str(beside) or not beside.exists():
        return "pagoda"
    return os.path.relpath(beside) if not os.path.relpath(beside).startswith("..") else str(beside)


def _ready_message(launcher: Launcher, args: argparse.Namespace) -> str:
    targets = ",".join(launcher.targets)
    pids = " ".join(str(pid) for pid in launcher.scheduler_pids)
    executors = ", ".join(f"{c.address} (pid {c.pid})" for c in launcher.executors)
    lines = [
        f"Pagoda is serving {args.model or 'default'} on {targets} "
        f"(scheduler pid{'s' if len(launcher.schedulers) > 1 else ''} {pids}; executors {executors})",
    ]
    if args.http_port:
        host = launcher.target.rsplit(":", 1)[0]
        urls = ", ".join(f"http://{host}:{args.http_port + i}/v1" for i in range(len(launcher.schedulers)))
        lines.append(f"OpenAI-compatible API: {urls}")
    lines += [
        "Try:",
        f'  {_pagoda_command()} chat "What is the capital of France?" --target {targets}',
        "A child that exits is restarted." if launcher.supervisor else "A child that exits stops everything.",
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def _launcher_events_on_stderr() -> Iterator[None]:
    """The launcher's log lines (child exits, restarts, waits) on stderr while serving."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s launcher %(levelname)s %(message)s"))
    log = logging.getLogger("pagoda.launch")
    previous_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(previous_level)


def cmd_serve(args: argparse.Namespace, scheduler_passthrough: Sequence[str]) -> int:
    """Start, wait for a signal or a dead child, stop everything."""
    from pagoda.launch.launcher import LauncherError

    try:
        launcher = launcher_from_args(args, scheduler_passthrough)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    state = {"ready": False}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not state["ready"] and not stop.is_set():
            stop.set()
            raise _Interrupted
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with _launcher_events_on_stderr():
            return _serve_until_stopped(launcher, args, stop, state)
    except _Interrupted:
        return 0
    except LauncherError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve_until_stopped(
    launcher: Launcher, args: argparse.Namespace, stop: threading.Event, state: dict[str, bool]
) -> int:
    launcher.start()
    state["ready"] = True
    print(_ready_message(launcher, args), flush=True)
    try:
        while not stop.wait(0.5):
            launcher.check()
        print("stopping...", file=sys.stderr, flush=True)
        return 0
    finally:
        launcher.stop()
