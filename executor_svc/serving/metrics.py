"""Prometheus metrics of one executor (names follow vLLM's where they exist)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.step import StepResult

if TYPE_CHECKING:
    from executor_svc.kv.tier.store import TierStore

_MS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ExecutorMetrics:
    """Step-level metrics, registered in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.forward_s = Histogram(
            "pagoda_executor_forward_seconds", "Model forward time per step", buckets=_MS_BUCKETS, registry=r
        )
        self.sample_s = Histogram(
            "pagoda_executor_sample_seconds", "Sampling time per step", buckets=_MS_BUCKETS, registry=r
        )
        self.draft_s = Histogram(
            "pagoda_executor_draft_seconds",
            "Draft model time per step that drafted with it",
            buckets=_MS_BUCKETS,
            registry=r,
        )
        self.step_s = Histogram(
            "pagoda_executor_step_seconds", "Whole step time inside the executor", buckets=_MS_BUCKETS, registry=r
        )
        self.idle_s = Histogram(
            "pagoda_executor_idle_seconds", "Wait for the next plan after a step", buckets=_MS_BUCKETS, registry=r
        )
        self.tokens_per_step = Histogram(
            "pagoda_executor_tokens_per_step", "Tokens computed per step", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.steps = Counter("pagoda_executor_steps", "Steps executed", registry=r)
        self.tokens = Counter("pagoda_executor_tokens", "Tokens computed", registry=r)
        self.seq_errors = Counter("pagoda_executor_sequence_errors", "Sequences that failed alone", registry=r)
        self.num_sequences = Gauge("pagoda_executor_num_sequences", "Sequences held", registry=r)
        self.kv_blocks = Gauge("pagoda_executor_kv_blocks", "KV cache blocks allocated", registry=r)
        self.warmup_s = Gauge(
            "pagoda_executor_warmup_seconds", "Start-up warm-up steps run before READY (runner.warmup)", registry=r
        )
        # Exposed as pagoda_executor_kernel_info{attention=...,gemm=...,...} 1
        self.kernel_info = Info(
            "pagoda_executor_kernel", "Kernel paths the executor runs (executor_svc.native.active)", registry=r
        )
        self.tier_load_s = Histogram(
            "pagoda_executor_kv_offload_load_seconds",
            "Filling one step's loads from the offload tier",
            buckets=_MS_BUCKETS,
            registry=r,
        )
        self.tier_store_s = Histogram(
            "pagoda_executor_kv_offload_store_seconds",
            "Storing one block in the offload tier (writer thread)",
            buckets=_MS_BUCKETS,
            registry=r,
        )

    def observe_step(self, out: StepResult, step_ns: int, idle_ns: int, num_sequences: int) -> None:
        """Record one step."""
        self.forward_s.observe(out.timings.forward_ns / 1e9)
        self.sample_s.observe(out.timings.sample_ns / 1e9)
        if out.timings.draft_ns:
            self.draft_s.observe(out.timings.draft_ns / 1e9)
        self.step_s.observe(step_ns / 1e9)
        self.idle_s.observe(idle_ns / 1e9)
        self.tokens_per_step.observe(out.num_scheduled_tokens)
        self.steps.inc()
        self.tokens.inc(out.num_scheduled_tokens)
        self.seq_errors.inc(len(out.errors))
        self.num_sequences.set(num_sequences)

    def watch_tier(self, store: TierStore) -> None:
        """Export the offload tier's counters, read at scrape time."""
        self.registry.register(_TierCollector(store))

    def set_kernels(self, kernels: Mapping[str, str]) -> None:
        """Record the active kernel paths (once the model is loaded)."""
        self.kernel_info.info(dict(kernels))

    def serve(self, host: str, port: int) -> None:
        """Expose /metrics on host:port (a daemon thread)."""
        start_http_server(port, addr=host, registry=self.registry)


class _TierCollector(Collector):
    """The offload tier's counters (executor_svc.kv.tier.TierStats) and sizes, read at scrape time."""

    def __init__(self, store: TierStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        store, stats = self._store, self._store.stats
        p = "pagoda_executor_kv_offload_"
        yield _labelled(p + "hits", "Blocks loaded from the tier, by where they were", "tier", stats.hits)
        yield _labelled(p + "misses", "Blocks the tier could not give, by reason", "reason", stats.misses)
        yield _labelled(p + "rejected_blocks", "Stored blocks rejected by a check, by reason", "reason", stats.rejected)
        yield _labelled(p + "dropped_writes", "Blocks not stored, by reason", "reason", stats.dropped_writes)
        yield CounterMetricFamily(p + "read_bytes", "Bytes read from the disk tier", value=stats.bytes_read)
        yield CounterMetricFamily(p + "written_bytes", "Bytes written to the disk tier", value=stats.bytes_written)
        yield CounterMetricFamily(p + "written_blocks", "Blocks written to the disk tier", value=stats.blocks_written)
        blocks = GaugeMetricFamily(p + "blocks", "Blocks held, by tier", labels=["tier"])
        held = GaugeMetricFamily(p + "bytes", "Bytes held, by tier", labels=["tier"])
        for name, tier in (("memory", store.memory), ("disk", store.disk)):
            if tier is not None:
                blocks.add_metric([name], len(tier))
                held.add_metric([name], tier.num_bytes)
        blocks.add_metric(["queued"], store.num_queued_bytes // store.ns.block_nbytes)
        held.add_metric(["queued"], store.num_queued_bytes)
        yield blocks
        yield held


def _labelled(name: str, text: str, label: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=[label])
    for key, value in sorted(counts.items()):
        family.add_metric([key], value)
    return family
