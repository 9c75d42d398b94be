"""Benchmark output: the text report, the JSON file and the PNG charts."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagoda_bench.metrics import RequestRecord, tokens_per_second_series

_LATENCIES = (
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)


def _line(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:>12}"


def format_report(name: str, metrics: Mapping[str, Any], new_prompts: bool = False) -> str:
    """The ``vllm bench serve``-style summary of one run; with ``new_prompts`` (the random workload, whose
    prompts share nothing) a warning when the server still served prompt tokens from a cache."""
    lines = [f"{' Serving Benchmark Result (' + name + ') ':=^52}"]
    lines += [
        _line("Successful requests:", metrics["completed"]),
        _line("Failed requests:", metrics["failed"]),
        _line("Benchmark duration (s):", float(metrics["duration_s"])),
        _line("Total input tokens:", metrics["total_input_tokens"]),
        _line("Total generated tokens:", metrics["total_output_tokens"]),
        _line("Prefix-cached prompt tokens:", metrics.get("total_cached_tokens", 0)),
        _line("Request throughput (req/s):", float(metrics["request_throughput"])),
        _line("Output token throughput (tok/s):", float(metrics["output_throughput"])),
        _line("Total token throughput (tok/s):", float(metrics["total_token_throughput"])),
    ]
    if "goodput" in metrics:
        lines.append(_line("Request goodput (req/s):", float(metrics["goodput"])))
    for key, short, title in _LATENCIES:
        stats = metrics[key]
        lines.append(f"{' ' + title + ' ':-^52}")
        lines += [
            _line(f"Mean {short} (ms):", float(stats["mean"])),
            _line(f"Median {short} (ms):", float(stats["median"])),
            _line(f"P90 {short} (ms):", float(stats["p90"])),
            _line(f"P99 {short} (ms):", float(stats["p99"])),
        ]
    lines.append("=" * 52)
    cached = metrics.get("total_cached_tokens", 0)
    if new_prompts and cached:
        lines.append(
            f"warning: {cached} of {metrics['total_input_tokens']} prompt tokens came from the server's cache: it had "
            "seen these prompts (an earlier run with this --seed, or a KV tier kept across restarts, as pagoda "
            "serve's disk tier is), so the figures include cache hits; a new --seed sends new prompts"
        )
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(
    path: str | Path,
    config: Mapping[str, Any],
    runs: Mapping[str, tuple[Mapping[str, Any], Sequence[RequestRecord]]],
    extra: Mapping[str, Any] | None = None,
) -> None:
    """All metrics and per-request records of every run, as one JSON file."""
    document = {
        "config": dict(config),
        "runs": {
            name: {"metrics": dict(metrics), "requests": [r.to_dict() for r in records]}
            for name, (metrics, records) in runs.items()
        },
        **(extra or {}),
    }
    Path(path).write_text(json.dumps(_json_safe(document), indent=2) + "\n")


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def write_plots(directory: str | Path, runs: Mapping[str, Sequence[RequestRecord]]) -> list[Path]:
    """``latency_cdf.png`` (TTFT, TPOT, ITL, E2E) and ``throughput.png``
    (output tokens/s over time), one line per run. Imports matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (key, short, title) in zip(axes.flat, _LATENCIES):
        for name, records in runs.items():
            done = [r for r in records if r.success]
            values = {
                "ttft_ms": [r.ttft_s * 1e3 for r in done],
                "tpot_ms": [r.tpot_s * 1e3 for r in done if r.output_len > 1],
                "itl_ms": [g * 1e3 for r in done for g in r.itls_s],
                "e2el_ms": [r.e2el_s * 1e3 for r in done],
            }[key]
            if values:
                axis.plot(*_cdf(values), label=name)
        _label(axis, title, f"{short} (ms)", "fraction of requests")
    cdf_path = _save(plt, figure, out / "latency_cdf.png")
    figure, axis = plt.subplots(figsize=(10, 4))
    for name, records in runs.items():
        series = tokens_per_second_series([r for r in records if r.success])
        if series:
            axis.step([t for t, _ in series], [v for _, v in series], where="post", label=name)
    _label(axis, "Output tokens/s over time", "time (s)", "tokens/s")
    return [cdf_path, _save(plt, figure, out / "throughput.png")]


def _label(axis: Any, title: str, xlabel: str, ylabel: str) -> None:
    """Title, axis labels, a light grid and the legend of one chart."""
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axis.grid(True, alpha=0.3)
    axis.legend()


def _save(plt: Any, figure: Any, path: Path) -> Path:
    """Writes ``figure`` to ``path`` (PNG, 100 dpi) and closes it."""
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
