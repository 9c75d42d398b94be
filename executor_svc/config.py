"""Executor configuration: one dataclass, filled from flags and PAGODA_* env."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pagoda.runtime.flags import parse_config, parse_size


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
    """Settings of one executor process (see docs/configuration.md)."""

    host: str = dataclasses.field(default="127.0.0.1", metadata=_help("address to bind"))
    port: int = dataclasses.field(default=50061, metadata=_help("gRPC port"))
    model: str = dataclasses.field(default="default", metadata=_help("checkpoint folder, .gguf file, or 'default'"))
    model_name: str = dataclasses.field(default="", metadata=_help("name reported to clients"))
    model_cache_dir: str = dataclasses.field(default="", metadata=_help("cache for the default model"))
    dtype: str = dataclasses.field(default="auto", metadata=_help("float32, bfloat16, float16 or auto"))
    kv_cache_dtype: str = dataclasses.field(
        default="auto", metadata=_help("auto (= dtype), float32, bfloat16, float16, or int8 (rows + scales)")
    )
    quantization: str = dataclasses.field(
        default="auto",
        metadata=_help("linear weights: auto (a .gguf file: gguf, else none), none, int8, gguf, q8_0, q4_0"),
    )
    quantized_activations: str = dataclasses.field(
        default="auto", metadata=_help("int8 layers' activations: auto, int8 or bf16 (weight-only)")
    )
    kv_cache_memory: int | None = dataclasses.field(
        default=None, metadata=_help("bytes for the KV cache (default 1GiB on CPU)", parse=parse_size)
    )
    kv_cache_memory_fraction: float = dataclasses.field(
        default=0.85, metadata=_help("CUDA: fraction of free memory for the KV cache")
    )
    block_size: int = dataclasses.field(
        default=0, metadata=_help("tokens per KV block; 0 = auto (CUDA 16; CPU one 4 KiB page per kv head)")
    )
    kv_offload_dir: str = dataclasses.field(
        default="", metadata=_help("KV offload tier on disk: its directory, kept across restarts ('' = no disk tier)")
    )
    kv_offload_size: int = dataclasses.field(
        default=10 * 2**30, metadata=_help("capacity of the disk tier (LRU beyond it)", parse=parse_size)
    )
    kv_offload_memory: int = dataclasses.field(
        default=0, metadata=_help("host-memory tier in front of the disk (pinned on CUDA); 0 = none", parse=parse_size)
    )
    kv_offload_queue: int = dataclasses.field(
        default=256 * 2**20, metadata=_help("blocks waiting to be stored, at most (more are dropped)", parse=parse_size)
    )
    kv_offload_dir_next_free: bool = dataclasses.field(
        default=False, metadata=_help("--kv-offload-dir held by another process: use the first free DIR.N instead")
    )
    max_model_len: int | None = dataclasses.field(default=None, metadata=_help("cap on context length"))
    draft_model: str = dataclasses.field(
        default="",
        metadata=_help(
            "draft model proposing speculative tokens (--speculative draft on the scheduler): a checkpoint "
            "folder or .gguf with the model's tokenizer, or 'default'; empty: none"
        ),
    )
    device: str = dataclasses.field(default="auto", metadata=_help("cpu, cuda, cuda:N or auto"))
    attention_backend: str = dataclasses.field(default="auto", metadata=_help("auto, cpp, torch or triton"))
    layer_ops: str = dataclasses.field(default="auto", metadata=_help("auto, cpp or torch"))
    num_threads: int | None = dataclasses.field(default=None, metadata=_help("torch intra-op threads"))
    max_message_bytes: int = dataclasses.field(
        default=64 * 2**20, metadata=_help("largest plan message accepted", parse=parse_size)
    )
    metrics_port: int = dataclasses.field(default=0, metadata=_help("Prometheus port, 0 = off"))
    log_format: str = dataclasses.field(default="auto", metadata=_help("json, console or auto"))
    otlp_endpoint: str = dataclasses.field(
        default="", metadata=_help("OTLP/gRPC collector for traces (default: OTEL_* variables; off)")
    )
    drain_timeout_s: float = dataclasses.field(default=30.0, metadata=_help("SIGTERM: time to finish work"))
    tls_cert: str = dataclasses.field(default="", metadata=_help("server certificate (PEM)"))
    tls_key: str = dataclasses.field(default="", metadata=_help("server private key (PEM)"))
    tls_ca: str = dataclasses.field(default="", metadata=_help("CA that must sign client certificates (mTLS)"))
    simulate: bool = dataclasses.field(
        default=False, metadata=_help("no model: a cost-model step time and deterministic tokens (no torch)")
    )
    simulate_kv_blocks: int = dataclasses.field(default=4096, metadata=_help("--simulate: KV blocks reported"))
    simulate_vocab_size: int = dataclasses.field(default=512, metadata=_help("--simulate: tokenizer vocabulary size"))
    simulate_time_scale: float = dataclasses.field(
        default=1.0, metadata=_help("--simulate: multiplies the modelled step time (0: no sleep)")
    )

    def __post_init__(self) -> None:
        if self.block_size < 0:
            raise ValueError("--block-size must be positive (or 0 for auto)")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("--kv-cache-memory-fraction must be in (0, 1]")
        if self.simulate_kv_blocks < 1:
            raise ValueError("--simulate-kv-blocks must be positive")
        for name in ("kv_offload_size", "kv_offload_memory", "kv_offload_queue"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative")
        if self.simulate_time_scale < 0:
            raise ValueError("--simulate-time-scale must not be negative")
        if self.simulate and self.draft_model:
            raise ValueError("--draft-model needs a model: a simulated executor (--simulate) has no draft model")
        if self.simulate:
            from executor_svc.simulate_tokenizer import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE

            if not MIN_VOCAB_SIZE <= self.simulate_vocab_size <= MAX_VOCAB_SIZE:
                raise ValueError(f"--simulate-vocab-size must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]")


def load_config(argv: Sequence[str] | None = None) -> ExecutorConfig:
    """Parse flags and environment into an ExecutorConfig."""
    return parse_config(ExecutorConfig, argv, "pagoda-executor", "Pagoda executor: model, KV cache, paged attention.")
