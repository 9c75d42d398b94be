"""A/B throughput of two checkouts' servers on the same workload, measured in one run.

Each round starts checkout A's ``pagoda serve`` (from its own venv), runs the
same ``pagoda bench`` workload against it, stops it, then does the same for
checkout B (and C, if given); each checkout goes first in turn, so drift on a
shared machine hits all alike. The client is this interpreter's ``pagoda``, the
same for every checkout. Prints each run's output tokens/s, the medians and
the ratios to A.

A checkout from before the kernels were built at install time compiles them
with torch's JIT loader into ``TORCH_EXTENSIONS_DIR`` and silently runs the
torch code when the cached build is older than its sources: point that
variable at the cache its ``make install`` filled.

``--env-a/-b/-c`` add environment variables to one checkout's server, and
``--serve-args-a/-b/-c`` flags to its ``pagoda serve``, so one checkout can be
measured two ways (the same path as B and C). ``{tmpdir}`` in any serve
arguments is a new empty directory for each run: a checkout with the KV
offload tier (on by default) would otherwise serve repeated prompts from the
tier of the run before (``--kv-offload-dir {tmpdir}``: a cold tier each run;
``--kv-offload-dir ''``: none). ``--otlp-sink``
starts an OTLP/gRPC receiver in this process that counts the spans it gets;
``{otlp}`` in those variables is its endpoint (tracing on, exported locally).

Usage:
    python bench/ab_serve.py --a /path/to/checkout-before --b . --rounds 3 \\
        --serve-args "--dtype bfloat16 --kv-cache-memory 1GiB" \\
        --bench-args "--num-prompts 64 --input-len-range 16:512 --output-len-range 16:256 --seed 0"
    # the KV offload tier off and on, cold (docs/kv-offload.md):
    python bench/ab_serve.py --a . --b . --serve-args-a "--kv-offload-dir ''" \\
        --serve-args-b "--kv-offload-dir {tmpdir}"
    # tracing off and on (docs/tracing.md):
    python bench/ab_serve.py --a /path/to/checkout-before --b . --c . --otlp-sink \\
        --env-c "OTEL_EXPORTER_OTLP_ENDPOINT={otlp}"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stop_signals import stop_on_signals

from pagoda.runtime.ports import free_port

READY_TIMEOUT_S = 900.0
BENCH_TIMEOUT_S = 1800.0


def _wait_ready(bench: Path, target: str, server: subprocess.Popen[bytes]) -> None:
    """Until ``pagoda status`` answers with a READY executor (bounded, logged)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"server exited with {server.returncode} before it was ready")
        probe = subprocess.run(
            [str(bench), "status", "--target", target, "--json"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0 and '"READY"' in probe.stdout:
            return
        time.sleep(1.0)
    raise SystemExit(f"no READY executor at {target} after {READY_TIMEOUT_S:.0f}s")


class SpanSink:
    """An OTLP/gRPC trace receiver on 127.0.0.1 that only counts the spans it gets (opentelemetry-proto)."""

    def __init__(self) -> None:
        import concurrent.futures
        import threading

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self
        self.num_spans = 0
        self._lock = threading.Lock()

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                count = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                with sink._lock:
                    sink.num_spans += count
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.endpoint = f"http://127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def take(self) -> int:
        """Spans received since the last call."""
        with self._lock:
            count, self.num_spans = self.num_spans, 0
        return count


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its descendants (Linux /proc)."""
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:  # exited meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        stack += [int(child) for child in children]
    return total


def _stop_group(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (it drains), SIGKILL it after 60 s; a group already gone is fine."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    except ProcessLookupError:
        server.wait()
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def run_once(
    checkout: Path, client: Path, serve_args: list[str], bench_args: list[str], log: Path, env: dict[str, str]
) -> tuple[float, float]:
    """(output tokens/s, CPU ms per output token) of one served run of ``checkout`` (its server gets ``env``).

    The CPU time is the server's (launcher, scheduler, executors) while the
    benchmark runs: on a shared machine it varies far less than throughput does.
    """
    port = free_port()
    target = f"127.0.0.1:{port}"
    run_dir = tempfile.mkdtemp(prefix="ab-serve-")
    serve_args = [arg.replace("{tmpdir}", run_dir) for arg in serve_args]
    serve = [str(checkout / ".venv" / "bin" / "pagoda"), "serve", "--port", str(port), *serve_args]
    with open(log, "ab") as out:
        server = subprocess.Popen(
            serve,
            cwd=checkout,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_ready(client, target, server)
        cpu_before = _tree_cpu_s(server.pid)
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "bench.json"
            bench = [str(client), "bench", "--target", target, "--no-progress", "--json", str(report), *bench_args]
            subprocess.run(bench, check=True, timeout=BENCH_TIMEOUT_S, stdout=subprocess.DEVNULL)
            metrics = json.loads(report.read_text())["runs"]["pagoda"]["metrics"]
        cpu_ms = (_tree_cpu_s(server.pid) - cpu_before) * 1e3
    finally:
        _stop_group(server)
        shutil.rmtree(run_dir, ignore_errors=True)
    return float(metrics["output_throughput"]), cpu_ms / float(metrics["total_output_tokens"])


def _env(text: str, sink: SpanSink | None) -> dict[str, str]:
    """``KEY=VALUE ...`` as a dict; ``{otlp}`` is the sink's endpoint."""
    pairs = [item.split("=", 1) for item in shlex.split(text)]
    if sink is None and "{otlp}" in text:
        raise SystemExit("{otlp} needs --otlp-sink")
    return {key: value.replace("{otlp}", sink.endpoint if sink else "") for key, value in pairs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, type=Path, help="checkout A (its .venv is used); the reference")
    parser.add_argument("--b", required=True, type=Path, help="checkout B (its .venv is used)")
    parser.add_argument("--c", type=Path, default=None, help="optionally a third checkout, C")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve-args", default="--dtype bfloat16 --kv-cache-memory 1GiB")
    parser.add_argument(
        "--bench-args",
        default="--num-prompts 64 --input-len-range 16:512 --output-len-range 16:256 --seed 0",
    )
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "ab_serve.log")
    for name in "abc":
        parser.add_argument(f"--env-{name}", default="", help=f"KEY=VALUE ... added to {name.upper()}'s server")
        parser.add_argument(f"--serve-args-{name}", default="", help=f"flags added to {name.upper()}'s pagoda serve")
    parser.add_argument("--otlp-sink", action="store_true", help="count spans at {otlp}, a local OTLP receiver")
    args = parser.parse_args()
    stop_on_signals()
    sink = SpanSink() if args.otlp_sink else None
    given = {"A": args.a, "B": args.b, "C": args.c}
    checkouts = {name: path.resolve() for name, path in given.items() if path is not None}
    names = list(checkouts)
    client = Path(sys.executable).parent / "pagoda"
    results: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    envs = {name: _env(getattr(args, f"env_{name.lower()}"), sink) for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)  # each checkout goes first in turn
        for name in names[shift:] + names[:shift]:
            serve_args = shlex.split(args.serve_args) + shlex.split(getattr(args, f"serve_args_{name.lower()}"))
            bench_args = shlex.split(args.bench_args)
            tok_s, cpu_ms = run_once(checkouts[name], client, serve_args, bench_args, args.log, envs[name])
            results[name].append(tok_s)
            cpu[name].append(cpu_ms)
            spans = f", {sink.take()} spans exported" if sink is not None else ""
            print(
                f"round {round_index + 1} {name}: {tok_s:.1f} output tok/s, {cpu_ms:.3f} CPU ms/token{spans}",
                flush=True,
            )
    medians = {name: statistics.median(values) for name, values in results.items()}
    for name, values in results.items():
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"{name} ({checkouts[name]}): median {medians[name]:.1f} output tok/s [{runs}]")
    cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
    for name in names:
        runs = ", ".join(f"{v:.3f}" for v in cpu[name])
        print(f"{name}: median {cpu_medians[name]:.3f} CPU ms per output token [{runs}]")
    for name in names[1:]:
        ratio, cpu_ratio = medians[name] / medians["A"], cpu_medians[name] / cpu_medians["A"]
        print(f"{name}/A = {ratio:.3f} (throughput), {cpu_ratio:.3f} (CPU per token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
