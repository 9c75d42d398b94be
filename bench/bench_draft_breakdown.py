"""Where a draft model's time goes at batch 1: the executor's own step metrics, per variant, side by side.

Usage:
    python bench/bench_draft_breakdown.py [--variants off,draft-small,draft-self] [--num-requests 4]

Each variant (as in bench_speculative.py) gets a fresh ``pagoda serve`` with the
executor's Prometheus port on; one grounded request warms it up, then the first
``--num-requests`` requests of ``spec_workload.py`` run one at a time. Printed per
variant: output tokens/s and wall time, the drafts (attempts, acceptance), and the
executor's totals over those requests: draft-model passes (seconds, steps that
ran them), forward, whole steps, and the wait for plans (idle: what plans that do
not overlap cost). The differences to ``off`` say where the time goes. SIGTERM or
Ctrl-C stops the server it started (its whole process group) before exiting.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import bench_speculative as spec
from ab_serve import _free_port
from spec_workload import grounded_requests

# Executor metrics summed over the measured requests: (label, Prometheus sample).
METRICS = (
    ("draft passes s", "pagoda_executor_draft_seconds_sum"),
    ("steps that drafted", "pagoda_executor_draft_seconds_count"),
    ("forward s", "pagoda_executor_forward_seconds_sum"),
    ("steps s", "pagoda_executor_step_seconds_sum"),
    ("idle s", "pagoda_executor_idle_seconds_sum"),
    ("steps", "pagoda_executor_steps_total"),
)


def scrape(port: int) -> dict[str, float]:
    """The executor's metric samples (name -> value), bounded by a 10 s timeout."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def measure(variant: str, requests: list, serve_args: list[str], drafts: dict[str, Path], log: Path) -> None:
    port = _free_port()
    args = [*serve_args, "--executor-args", f"--metrics-port {port}", *spec.variant_args(variant, None, drafts)]
    server, target = spec.serve(args, log)
    try:
        spec.grounded(target, requests[:1], 1)  # warm-up
        before = scrape(port)
        start = time.perf_counter()
        tok_s, _, outputs, counters = spec.grounded(target, requests, 1)
        wall = time.perf_counter() - start
        after = scrape(port)
    finally:
        spec.stop(server)
    totals = ", ".join(f"{label} {after.get(name, 0) - before.get(name, 0):.3f}" for label, name in METRICS)
    num_tokens = sum(len(o) for o in outputs)
    print(f"{variant}: {tok_s:.1f} output tok/s, {wall:.2f} s for {num_tokens} tokens; {spec.describe(counters)}")
    print(f"  model drafts {counters['spec_model_num_drafts_total']}; executor: {totals}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="off,draft-small,draft-self")
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--serve-args", default="--dtype bfloat16 --kv-cache-memory 1GiB --kv-offload-dir ''")
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench_draft_breakdown.log")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := {v.partition("@")[0] for v in variants} - set(spec.VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    signal.signal(signal.SIGTERM, spec._stop_servers)
    requests = grounded_requests(max(args.num_requests, 1))
    with tempfile.TemporaryDirectory() as tmp:
        drafts = spec.build_drafts(variants, 8, Path(tmp))
        for variant in variants:
            measure(variant, requests, shlex.split(args.serve_args), drafts, args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
