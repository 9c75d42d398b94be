"""Prometheus metrics of one executor (names follow vLLM's where they exist)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from pagoda.step import StepResult

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
        # Exposed as pagoda_executor_kernel_info{attention=...,gemm=...,...} 1
        self.kernel_info = Info(
            "pagoda_executor_kernel", "Kernel paths the executor runs (executor_svc.native.active)", registry=r
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

    def set_kernels(self, kernels: Mapping[str, str]) -> None:
        """Record the active kernel paths (once the model is loaded)."""
        self.kernel_info.info(dict(kernels))

    def serve(self, host: str, port: int) -> None:
        """Expose /metrics on host:port (a daemon thread)."""
        start_http_server(port, addr=host, registry=self.registry)
