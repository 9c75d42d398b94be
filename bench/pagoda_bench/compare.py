"""``pagoda bench --server ...``: several servers measured on the same workload, in one run.

Each round starts every server in turn (the order rotates by one each round, so none always runs first or
right after another's load), sends the workload ``--runs-per-start`` times through the OpenAI backend, and stops
it: the servers never share the machine. The first run after a start is the *first run* a user meets; the
others are the *steady state*. Run k of round r draws its prompt lengths with seed ``--seed + k`` (the same
for every server at the same place) and its token ids salted with ``--prompt-salt`` (a fresh salt each
invocation unless given), the round and the server's name: each run's prompts are new to the server, even to
one that keeps its KV cache across starts (``pagoda serve``'s disk tier: the same prompts again would be loaded
from it and most of the prefill skipped) or shares its cache directory with another server of the comparison.
The table's "cached %" is the share of prompt tokens any run was served from a cache; above 0 on the random
workload the run did not measure a prefill, and a warning says so. The table gives,
per server, the medians over rounds of both, how long the server took to answer, and each steady rate as a
ratio of the first server's. ``NAME=hf[:DTYPE]`` puts transformers' ``generate`` in the rotation, run in
this process in its turn (its "start" is loading the model), so the baseline is measured in the same run too.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from pagoda_bench.metrics import RequestRecord, compute_metrics
from pagoda_bench.servers import ServerSpec, parse_server


class Started(Protocol):
    """A server while it runs (``servers.RunningServer``), or the in-process baseline once loaded."""

    spec: ServerSpec
    model: str
    ready_s: float

    def check_alive(self) -> None: ...


# A server started (and ready) for round ``label``; stopped when the context ends.
StartServer = Callable[[ServerSpec, str], AbstractContextManager[Started]]
# (records, duration_s) of round r's run k (lengths from seed --seed + k, ids salted per salt, round and server)
# sent to a started server.
RunWorkload = Callable[[Started, int, int], tuple[list[RequestRecord], float]]


@dataclass
class ServerRuns:
    """What one server did over the rounds: per start, its runs' metrics, and its start-up times."""

    spec: ServerSpec
    starts: list[list[dict[str, Any]]] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)

    def first(self) -> list[float]:
        return [runs[0]["output_throughput"] for runs in self.starts if runs]

    def steady(self) -> list[float]:
        return [run["output_throughput"] for runs in self.starts for run in runs[1:]]

    def steady_ttft_ms(self) -> list[float]:
        return [run["ttft_ms"]["median"] for runs in self.starts for run in runs[1:]]

    def complete(self) -> bool:
        return all(run["failed"] == 0 and run["completed"] > 0 for runs in self.starts for run in runs)


def parse_servers(texts: Sequence[str], is_loopback: Callable[[str], bool]) -> list[ServerSpec]:
    """The ``--server`` flags; names are unique and every URL is this machine's."""
    specs = [parse_server(text) for text in texts]
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--server names must differ: {names}")
    for spec in specs:
        if spec.hf_dtype is None and not is_loopback(f"[{urlsplit(spec.base_url).hostname or ''}]:0"):
            raise ValueError(f"pagoda bench only targets loopback addresses, not {spec.base_url}")
    return specs


def rotated(specs: Sequence[ServerSpec], round_index: int) -> list[ServerSpec]:
    """Round ``round_index``'s order: the list rotated by the round number."""
    shift = round_index % len(specs)
    return [*specs[shift:], *specs[:shift]]


def run_rounds(
    args: argparse.Namespace, specs: Sequence[ServerSpec], start: StartServer, run: RunWorkload
) -> list[ServerRuns]:
    """Every round: each server started, measured ``args.runs_per_start`` times, stopped."""
    results = {spec.name: ServerRuns(spec) for spec in specs}
    for round_index in range(args.rounds):
        for spec in rotated(specs, round_index):
            label = f"round{round_index + 1}"
            with start(spec, label) as server:
                runs: list[dict[str, Any]] = []
                results[spec.name].starts.append(runs)
                results[spec.name].ready_s.append(server.ready_s)
                print(f"[{label}] {spec.name} answered after {server.ready_s:.1f}s ({server.model})", flush=True)
                for index in range(args.runs_per_start):
                    records, duration_s = run(server, round_index, index)
                    server.check_alive()
                    metrics = compute_metrics(records, duration_s)
                    runs.append(metrics)
                    kind = "first" if index == 0 else "steady"
                    print(
                        f"[{label}] {spec.name} run {index + 1} ({kind}): {metrics['output_throughput']:.1f} tok/s, "
                        f"median TTFT {metrics['ttft_ms']['median']:.0f} ms, {metrics['failed']} failed, "
                        f"{cached_percent(metrics):.0f}% of prompt tokens cached",
                        flush=True,
                    )
    return [results[spec.name] for spec in specs]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _spread(values: Sequence[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}" if values else "-"


def cached_percent(metrics: dict[str, Any]) -> float:
    """Share of a run's prompt tokens served from a cache (prefix cache or offload tier), in percent."""
    return 100 * metrics.get("total_cached_tokens", 0) / max(1, metrics.get("total_input_tokens", 0))


def format_comparison(results: Sequence[ServerRuns], expect_uncached: bool = False) -> str:
    """The table: first-run and steady output tok/s (medians, with their spread), TTFT, start-up, ratios, and
    the most of any run's prompt tokens served from a cache; with ``expect_uncached`` (prompts new to every
    server) a warning under it names each server that was served any."""
    base = _median(results[0].steady())
    versus = "steady vs " + results[0].spec.name
    width = max(20, len(versus) + 2)  # long server names keep their columns apart
    names = max(16, 1 + max(len(r.spec.name) for r in results))
    header = (
        f"{'server':<{names}}{'first run tok/s':>18}{'steady tok/s':>18}{'first/steady':>14}"
        f"{versus:>{width}}{'TTFT ms':>10}{'ready s':>9}{'cached %':>10}"
    )
    lines, warnings = [header, "-" * len(header)], []
    for result in results:
        first, steady = _median(result.first()), _median(result.steady())
        cached = max((cached_percent(run) for runs in result.starts for run in runs), default=0.0)
        lines.append(
            f"{result.spec.name:<{names}}{f'{first:.1f} ({_spread(result.first())})':>18}"
            f"{f'{steady:.1f} ({_spread(result.steady())})':>18}{first / steady:>14.2f}"
            f"{steady / base:>{width}.2f}{_median(result.steady_ttft_ms()):>10.0f}{_median(result.ready_s):>9.1f}"
            f"{cached:>10.1f}"
        )
        if expect_uncached and cached > 0:
            warnings.append(
                f"warning: {result.spec.name} was served up to {cached:.1f}% of a run's prompt tokens from a cache "
                "although every run's prompts were new: its figures include cache hits, not only prefills"
            )
    lines.append(
        "medians over rounds (min-max in parentheses); steady: every run after a start's first; cached %: the most "
        "of any run's prompt tokens served from a cache"
    )
    return "\n".join(lines + warnings)


def comparison_json(results: Sequence[ServerRuns]) -> dict[str, Any]:
    """Per server: its command, start-up times and every run's metrics, by start."""
    return {
        r.spec.name: {
            "base_url": r.spec.base_url,
            "command": list(r.spec.command),
            "hf_dtype": r.spec.hf_dtype,
            "ready_s": r.ready_s,
            "first_run_output_throughput": _median(r.first()),
            "steady_output_throughput": _median(r.steady()),
            "starts": r.starts,
        }
        for r in results
    }


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a comparison (``--server`` given at least twice... or once, to measure one server's starts)."""
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=URL COMMAND",
        help="a server to start, measure over OpenAI's API and stop (repeat it to compare; docs/client.md)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --server: starts of each server")
    parser.add_argument(
        "--runs-per-start", type=int, default=3, help="with --server: workload runs per start (first + steady)"
    )
    parser.add_argument(
        "--prompt-salt",
        type=int,
        default=None,
        help="with --server: salt of the prompts' token ids (with the round and the server's name; default: a new "
        "one each invocation, so no server has seen the prompts)",
    )
    parser.add_argument("--server-start-timeout-s", type=float, default=900.0, help="bound on a server's start")
    parser.add_argument("--server-log-dir", default="bench-servers", help="with --server: the servers' output")


def check_compare_args(args: argparse.Namespace) -> None:
    """A comparison needs rounds, a first run and a steady one, and runs on OpenAI's API alone."""
    if args.rounds < 1 or args.runs_per_start < 2:
        raise ValueError("--server needs --rounds >= 1 and --runs-per-start >= 2 (a first run and a steady one)")
    if args.backend != "pagoda" or args.base_url or args.compare_hf or args.json_schema:
        raise ValueError("--server measures each server over OpenAI's API: no --backend, --base-url, --compare-hf")
