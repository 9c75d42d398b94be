"""Prometheus metrics of the scheduler, named after vLLM's so dashboards fit.

Counters are fed by the engine's hooks (on_step, step_tokens, ...); gauges read
an `EngineGauges` at scrape time, a few read-only figures the engine has.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.step import FinishReason, StepPlan, StepResult
from scheduler_svc.core.config import DraftSource
from scheduler_svc.fleet.executor_handle import ExecutorHandle, ExecutorState
from scheduler_svc.obs.step_histogram import StepHistogram, StepTokens

if TYPE_CHECKING:
    from scheduler_svc.core.scheduler import Scheduler
    from scheduler_svc.text.output_processor import RequestState

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
P = "pagoda:"


class EngineGauges(Protocol):
    """What the gauges read at scrape time (scheduler_svc.engine.Engine has these), never written here."""

    @property
    def num_running(self) -> int:
        """Requests running on executors."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests not yet running anywhere."""
        ...

    @property
    def executors(self) -> Mapping[str, ExecutorHandle]:
        """Every executor seen, by address: its state, and its scheduler core while driven."""
        ...


class SchedulerMetrics:
    """Request and step metrics in their own registry (so tests can build many)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.num_requests_running = Gauge(P + "num_requests_running", "Requests running on executors", registry=r)
        self.num_requests_waiting = Gauge(P + "num_requests_waiting", "Requests waiting", registry=r)
        self.kv_cache_usage_perc = Gauge(P + "kv_cache_usage_perc", "KV cache usage (0-1)", registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.lora_requests = Counter(
            P + "lora_requests", "Finished requests per LoRA adapter (docs/lora.md)", ["lora"], registry=r
        )
        self.lora_generation_tokens = Counter(
            P + "lora_generation_tokens",
            "Tokens generated per LoRA adapter, counted when requests end",
            ["lora"],
            registry=r,
        )
        self.rejected = Counter(P + "requests_rejected", "Requests refused because the queue was full", registry=r)
        self.prefix_cache_queries = Counter(P + "prefix_cache_queries", "Prefix cache queries (tokens)", registry=r)
        self.prefix_cache_hits = Counter(P + "prefix_cache_hits", "Prefix cache hits (tokens)", registry=r)
        self.num_preemptions = Counter(P + "num_preemptions", "Preemptions", registry=r)
        self.offload_hits = Counter(
            P + "kv_offload_hit_tokens", "Prompt tokens loaded from offload tiers instead of computed", registry=r
        )
        self.num_swaps = Counter(P + "num_swaps", "Preempted sequences resumed from an offload tier", registry=r)
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        # Fed a step at a time (StepTokens): one gap per sequence per step.
        self.itl = StepHistogram(P + "inter_token_latency_seconds", "Inter-token latency", _LATENCY_BUCKETS, r)
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds", "End-to-end latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Time waiting before first scheduled",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            P + "step_duration_seconds", "Plan sent to result received", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(P + "step_batch_tokens", "Tokens per step", buckets=_BATCH_BUCKETS, registry=r)
        self.batch_seqs = Histogram(
            P + "step_batch_sequences", "Sequences per step", buckets=_BATCH_BUCKETS, registry=r
        )
        # Speculative decoding, by draft source: ngram (the scheduler's lookups) or model (the draft model).
        source = ["source"]
        self.spec_drafts = Counter(
            P + "spec_decode_num_drafts", "Sequence-steps that verified draft tokens", source, registry=r
        )
        self.spec_draft_tokens = Counter(
            P + "spec_decode_num_draft_tokens", "Draft tokens proposed", source, registry=r
        )
        self.spec_accepted_tokens = Counter(
            P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", source, registry=r
        )
        self.spec_acceptance_rate = Gauge(
            P + "spec_decode_draft_acceptance_rate",
            "Accepted / proposed draft tokens (0 before any)",
            source,
            registry=r,
        )
        self.spec_tokens_per_step = Gauge(
            P + "spec_decode_mean_tokens_per_step",
            "Tokens a sequence gained per step that verified drafts (1 + accepted)",
            source,
            registry=r,
        )
        self.executor_restarts = Counter(
            P + "executor_restarts", "Executors seen again with a new incarnation", ["executor"], registry=r
        )
        # Executor address -> the incarnation last described (a new one is a restart).
        self._incarnations: dict[str, str] = {}
        # Scheduler-owned counters already exported, per scheduler core.
        self._exported: weakref.WeakKeyDictionary[Scheduler, tuple[int, ...]] = weakref.WeakKeyDictionary()
        self._spec_exported: weakref.WeakKeyDictionary[Scheduler, dict[DraftSource, tuple[int, int, int]]] = (
            weakref.WeakKeyDictionary()
        )
        # Source -> (sequence-steps with drafts, draft tokens, accepted ones), for GetStatus.
        self.spec_totals = {source: (0, 0, 0) for source in DraftSource}
        # Plain totals for the GetStatus RPC.
        self.num_requests_total = 0
        self.num_preemptions_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.offload_hit_tokens_total = 0
        self.num_swaps_total = 0

    def on_admitted(self, num_prompt_tokens: int) -> None:
        """Count an admitted request's prompt tokens."""
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_step(self, plan: StepPlan, result: StepResult, duration_s: float, scheduler: Scheduler) -> None:
        """Record a step, and export what the scheduler core counted since the last one."""
        counts = (
            scheduler.counters.num_preemptions,
            scheduler.kv.prefix_cache_queries,
            scheduler.kv.prefix_cache_hits,
            scheduler.counters.num_offload_hit_tokens,
            scheduler.counters.num_swaps,
        )
        last = self._exported.get(scheduler, (0, 0, 0, 0, 0))
        self._exported[scheduler] = counts
        preemptions, queries, hits, offload_hits, swaps = (now - before for now, before in zip(counts, last))
        self.num_preemptions.inc(preemptions)
        self.prefix_cache_queries.inc(queries)
        self.prefix_cache_hits.inc(hits)
        self.offload_hits.inc(offload_hits)
        self.num_swaps.inc(swaps)
        self.num_preemptions_total += preemptions
        self.prefix_cache_queries_total += queries
        self.prefix_cache_hits_total += hits
        self.offload_hit_tokens_total += offload_hits
        self.num_swaps_total += swaps
        if scheduler.drafter is not None:
            self._export_speculation(scheduler)
        self.step_duration.observe(duration_s)
        self.batch_size.observe(plan.num_scheduled_tokens)
        self.batch_seqs.observe(len(plan.new_seqs) + len(plan.scheduled_seqs))

    def _export_speculation(self, scheduler: Scheduler) -> None:
        """The drafter's counters since the last step, and the running totals' ratios, by source."""
        assert scheduler.drafter is not None
        exported = self._spec_exported.setdefault(scheduler, {})
        for source, stats in scheduler.drafter.stats.items():
            counts = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
            last = exported.get(source, (0, 0, 0))
            if counts == last:
                continue
            exported[source] = counts
            new = tuple(now - before for now, before in zip(counts, last))
            label = source.value
            self.spec_drafts.labels(label).inc(new[0])
            self.spec_draft_tokens.labels(label).inc(new[1])
            self.spec_accepted_tokens.labels(label).inc(new[2])
            drafts, drafted, accepted = (a + b for a, b in zip(self.spec_totals[source], new))
            self.spec_totals[source] = (drafts, drafted, accepted)
            self.spec_acceptance_rate.labels(label).set(accepted / max(drafted, 1))
            self.spec_tokens_per_step.labels(label).set(1 + accepted / max(drafts, 1))

    def spec_total(self, index: int, source: DraftSource | None = None) -> int:
        """A speculation total for GetStatus (index 0: drafts, 1: draft tokens, 2: accepted), of all sources."""
        sources = list(DraftSource) if source is None else [source]
        return sum(self.spec_totals[s][index] for s in sources)

    def step_tokens(self) -> StepTokens:
        """The accounting of one step's tokens: `add` per request, then `observe` once."""
        return StepTokens(self.generation_tokens, self.ttft, self.itl)

    def on_finished(self, state: RequestState, reason: FinishReason) -> None:
        """Count a finished request by its reason, with its latencies."""
        now = time.monotonic_ns()
        self.request_success.labels(finished_reason=reason.value).inc()
        self.num_requests_total += 1
        if state.seq.lora_name:
            self.lora_requests.labels(lora=state.seq.lora_name).inc()
            self.lora_generation_tokens.labels(lora=state.seq.lora_name).inc(len(state.seq.output_token_ids))
        self.e2e.observe((now - state.arrival_ns) / 1e9)
        if state.first_scheduled_ns is not None:
            self.queue_time.observe((state.first_scheduled_ns - state.arrival_ns) / 1e9)

    def on_executor_described(self, address: str, incarnation_id: str) -> None:
        """Count a restart when an executor comes back as a new incarnation."""
        last = self._incarnations.get(address)
        if last is not None and last != incarnation_id:
            self.executor_restarts.labels(executor=address).inc()
        self._incarnations[address] = incarnation_id

    def bind_gauges(self, gauges: EngineGauges) -> None:
        """Gauges read ``gauges`` at scrape time (never stale)."""
        self.registry.register(_ExecutorStates(gauges))
        self.num_requests_running.set_function(lambda: gauges.num_running)
        self.num_requests_waiting.set_function(lambda: gauges.num_waiting)
        self.kv_cache_usage_perc.set_function(lambda: kv_cache_usage(gauges))

    def serve(self, host: str, port: int) -> None:
        """Expose /metrics on host:port (a daemon thread)."""
        start_http_server(port, addr=host, registry=self.registry)


class _ExecutorStates(Collector):
    """`pagoda:executors{state}`: how many executors this scheduler sees in each state, read at scrape time."""

    def __init__(self, gauges: EngineGauges) -> None:
        self._gauges = weakref.ref(gauges)

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily(P + "executors", "Executors by state, as this scheduler sees them", labels=["state"])
        gauges = self._gauges()
        states = [e.state for e in gauges.executors.values()] if gauges is not None else []
        for state in ExecutorState:
            family.add_metric([state.value], states.count(state))
        return [family]


def kv_cache_usage(gauges: EngineGauges) -> float:
    """Used / total KV blocks over every live executor."""
    live = [e.scheduler for e in gauges.executors.values() if e.scheduler is not None]
    total = sum(s.config.num_blocks for s in live)
    used = sum(s.config.num_blocks - s.kv.num_free_blocks for s in live)
    return used / total if total else 0.0
