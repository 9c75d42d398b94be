"""Scheduler configuration: one dataclass, filled from flags and PAGODA_* env.

Each executor's scheduler core gets its own `SchedulerConfig` (scheduler_svc/core/config.py), which the engine
derives from this and what the executor reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pagoda.runtime.flags import parse_config, parse_size, setting
from pagoda.runtime.logs import EVENT_LOOPS
from pagoda.runtime.shared_settings import log_format_setting, lora_setting, lora_specs, otlp_endpoint_setting
from pagoda.step import MAX_DRAFT_TOKENS
from scheduler_svc.core.config import SPECULATIVE_METHODS

# Drafts per sequence and step: beyond this the chance that all are accepted is negligible.
MAX_SPECULATIVE_TOKENS = MAX_DRAFT_TOKENS


@dataclasses.dataclass(frozen=True)
class SchedulerServiceConfig:
    """Settings of the scheduler process (see docs/configuration.md)."""

    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(50051, "client gRPC port (Generation API, health, reflection)")
    executors: str = setting(
        "127.0.0.1:50061",
        "comma-separated `host:port`; a host name resolving to several addresses (a headless Service) is one "
        "executor per address, re-resolved every `--dns-refresh-s`",
    )
    scheduler_id: str = setting(
        "",
        "this scheduler's id in the executors' leases; unique per scheduler (Kubernetes: the pod name). Several "
        "schedulers over the same executors share them out, one driver per executor (docs/durability.md)",
        doc_default="`<hostname>:<port>`",
    )
    dns_refresh_s: float = setting(10.0, "executor re-resolution period")
    max_num_seqs: int = setting(256, "running sequences per executor", serve=True)
    max_num_batched_tokens: int = setting(2048, "token budget per step", serve=True)
    max_model_len: int | None = setting(None, "cap on prompt + output tokens", doc_default="executor's")
    max_prompt_tokens: int | None = setting(None, "longest accepted prompt", doc_default="max model len − 1")
    max_new_tokens: int = setting(4096, "cap on max_tokens")
    default_max_tokens: int = setting(256, "max_tokens when the request leaves it unset", serve=True)
    max_waiting_requests: int = setting(1024, "waiting-queue bound; beyond it `RESOURCE_EXHAUSTED`")
    max_message_bytes: int = setting(4 * 2**20, "largest client message accepted", parse=parse_size)
    max_stop_strings: int = setting(16, "most stop strings per request")
    max_stop_string_len: int = setting(256, "longest stop string (characters)")
    max_logprobs: int = setting(20, "most top logprobs per token (`logprobs`, `top_logprobs`, `prompt_logprobs`)")
    request_timeout_s: float = setting(600.0, "deadline for a request without one")
    enable_prefix_caching: bool = setting(True, "automatic prefix caching", serve=True)
    kv_offload: bool = setting(
        True,
        "use the KV offload tiers the executors report: save full blocks to them, load prefixes and swapped-out "
        "sequences from them (`false`: never; docs/kv-offload.md)",
    )
    speculative: str = setting(
        "off",
        "speculative decoding, draft tokens verified in the same step (docs/speculative-decoding.md): `ngram` "
        "(prompt lookup), `draft` (the executors' `--draft-model`), `ngram+draft` (n-gram drafts, the draft model "
        "where no n-gram matches); an executor without a draft model gets what is left (`ngram`, or `off`), with a "
        "warning",
        serve=True,
    )
    num_speculative_tokens: int | None = setting(
        None,
        f"most draft tokens per sequence and step (1-{MAX_SPECULATIVE_TOKENS}); a value given applies to both sources",
        serve=True,
        doc_default="8 n-gram, 4 draft model",
    )
    speculative_max_batch: int = setting(
        8, "no drafts while more sequences than this run on an executor (the step is compute-bound there)"
    )
    speculative_adaptive: bool = setting(
        True,
        "pause drafting where it does not pay, per sequence and for the draft model globally "
        "(docs/speculative-decoding.md); `false`: always draft where the batch rule allows",
    )
    lora: tuple[str, ...] = lora_setting(
        "a LoRA adapter to register on every executor, `NAME=PATH` (a PEFT folder on the executors' file system), "
        "also on executors that join or restart later; repeat the flag for more (docs/lora.md)",
        serve=False,
    )
    step_timeout_s: float = setting(60.0, "watchdog: a step longer than this marks the executor unhealthy")
    metrics_port: int = setting(0, "Prometheus `/metrics` port", doc_default="`0` (off)")
    http_port: int = setting(0, "OpenAI-compatible HTTP API port", doc_default="`0` (off)")
    api_keys_file: str = setting("", "file with one API key per line; clients must present one of them")
    api_keys: str = setting("", "comma-separated API keys (usually given as `PAGODA_API_KEYS`)")
    log_format: str = log_format_setting()
    otlp_endpoint: str = otlp_endpoint_setting()
    event_loop: str = setting(
        "uvloop",
        "the event loop: `uvloop` (libuv; its socket and timer paths in C: ~13% less scheduler CPU per token over SSE "
        "token, docs/durability.md) or `asyncio` (the standard library's)",
    )
    drain_timeout_s: float = setting(30.0, "on SIGTERM, time for in-flight requests to finish")
    tls_cert: str = setting("", "serve the client API over TLS with this certificate (PEM), with `--tls-key`")
    tls_key: str = setting("", "the private key of `--tls-cert` (PEM)")
    executor_tls_ca: str = setting("", "CA of the executors' certificates (mTLS to executors)")
    executor_tls_cert: str = setting("", "client certificate presented to executors")
    executor_tls_key: str = setting("", "key of that certificate")
    executor_tls_server_name: str = setting(
        "",
        "name the executors' certificates must carry, checked instead of the IP address the scheduler dials (DNS "
        "discovery yields pod IPs)",
    )

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
        lora_specs(self.lora)
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")

    @property
    def executor_targets(self) -> list[str]:
        """The executor entries as given (host:port each)."""
        return [t.strip() for t in self.executors.split(",") if t.strip()]


def load_config(argv: Sequence[str] | None = None) -> SchedulerServiceConfig:
    """Parse flags and environment into the config."""
    return parse_config(
        SchedulerServiceConfig, argv, "pagoda-scheduler", "Pagoda scheduler: client API, batching, KV block accounting."
    )
