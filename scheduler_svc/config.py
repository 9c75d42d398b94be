"""Scheduler configuration: one dataclass, filled from flags and PAGODA_* env."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pagoda.runtime.flags import parse_config, parse_size
from pagoda.step import MAX_DRAFT_TOKENS
from scheduler_svc.scheduler_types import SPECULATIVE_METHODS

# Drafts per sequence and step: beyond this the chance that all are accepted is negligible.
MAX_SPECULATIVE_TOKENS = MAX_DRAFT_TOKENS


def _f(default: Any, text: str, **extra: Any) -> Any:
    """A config field with its help text (and extra metadata, e.g. ``parse``)."""
    return dataclasses.field(default=default, metadata={"help": text, **extra})


@dataclasses.dataclass(frozen=True)
class SchedulerServiceConfig:
    """Settings of the scheduler process (see docs/configuration.md)."""

    host: str = _f("127.0.0.1", "address to bind")
    port: int = _f(50051, "client gRPC port")
    executors: str = _f("127.0.0.1:50061", "comma-separated executor host:port list")
    scheduler_id: str = _f(
        "", "this scheduler's id in executor leases (default <hostname>:<port>); unique per scheduler"
    )
    dns_refresh_s: float = _f(10.0, "executor address re-resolution period")
    max_num_seqs: int = _f(256, "running sequences per executor")
    max_num_batched_tokens: int = _f(2048, "token budget per step")
    max_model_len: int | None = _f(None, "cap on prompt + output tokens")
    max_prompt_tokens: int | None = _f(None, "longest accepted prompt (default max model len - 1)")
    max_new_tokens: int = _f(4096, "cap on max_tokens")
    default_max_tokens: int = _f(256, "max_tokens when a request leaves it unset")
    max_waiting_requests: int = _f(1024, "waiting-queue bound")
    max_message_bytes: int = _f(4 * 2**20, "largest client message", parse=parse_size)
    max_stop_strings: int = _f(16, "most stop strings per request")
    max_stop_string_len: int = _f(256, "longest stop string (characters)")
    max_logprobs: int = _f(20, "most top logprobs per token")
    request_timeout_s: float = _f(600.0, "deadline of a request without one")
    enable_prefix_caching: bool = _f(True, "automatic prefix caching")
    kv_offload: bool = _f(True, "use the KV offload tiers executors report: save blocks, load prefixes (false: never)")
    speculative: str = _f(
        "off",
        "speculative decoding: off, ngram (prompt lookup), draft (the executors' --draft-model), "
        "or ngram+draft (n-gram drafts, the draft model where none matches)",
    )
    num_speculative_tokens: int | None = _f(
        None, "most draft tokens per sequence and step, of either source; unset: 8 for n-gram, 4 for the draft model"
    )
    speculative_max_batch: int = _f(8, "no drafts while more sequences than this run on an executor")
    speculative_adaptive: bool = _f(
        True,
        "pause drafting where it does not pay, per sequence and for the draft model globally (false: always draft)",
    )
    step_timeout_s: float = _f(60.0, "watchdog: longest step before the executor is unhealthy")
    metrics_port: int = _f(0, "Prometheus port, 0 = off")
    http_port: int = _f(0, "OpenAI-compatible HTTP port, 0 = off")
    api_keys_file: str = _f("", "file with one API key per line")
    api_keys: str = _f("", "comma-separated API keys")
    log_format: str = _f("auto", "json, console or auto")
    otlp_endpoint: str = _f(
        "", "OTLP/gRPC collector for traces, e.g. http://127.0.0.1:4317 (default: OTEL_* variables; off)"
    )
    drain_timeout_s: float = _f(30.0, "SIGTERM: time for in-flight requests to finish")
    tls_cert: str = _f("", "client API certificate (PEM)")
    tls_key: str = _f("", "client API private key (PEM)")
    executor_tls_ca: str = _f("", "CA of the executors' certificates")
    executor_tls_cert: str = _f("", "client certificate presented to executors")
    executor_tls_key: str = _f("", "key of that certificate")
    executor_tls_server_name: str = _f("", "name to verify in executor certificates (executors are dialed by IP)")

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_new_tokens",
            "default_max_tokens",
            "max_waiting_requests",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}")
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.speculative_max_batch < 1:
            raise ValueError("--speculative-max-batch must be positive")

    @property
    def executor_targets(self) -> list[str]:
        """The executor entries as given (host:port each)."""
        return [t.strip() for t in self.executors.split(",") if t.strip()]


def load_config(argv: Sequence[str] | None = None) -> SchedulerServiceConfig:
    """Parse flags and environment into the config."""
    return parse_config(
        SchedulerServiceConfig, argv, "pagoda-scheduler", "Pagoda scheduler: client API, batching, KV block accounting."
    )
