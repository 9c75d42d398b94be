"""Executor configuration: one dataclass, filled from flags and PAGODA_* env."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pagoda.runtime.flags import parse_config, parse_size, setting
from pagoda.runtime.shared_settings import log_format_setting, lora_setting, lora_specs, otlp_endpoint_setting


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
    """Settings of one executor process (see docs/configuration.md)."""

    host: str = setting("127.0.0.1", "address to bind (`0.0.0.0` in a pod)")
    port: int = setting(50061, "gRPC port (Executor API, health, reflection)")
    model: str = setting(
        "default",
        "Hugging Face checkpoint folder, a `.gguf` file, or `default` (SmolLM2-135M-Instruct, prepared once into "
        "the cache)",
        serve=True,
    )
    model_name: str = setting("", "name reported to clients", doc_default="folder name")
    model_cache_dir: str = setting(
        "", "where the default model is prepared", doc_default="`~/.cache/pagoda` (`PAGODA_CACHE_DIR`)"
    )
    dtype: str = setting(
        "auto",
        "`float32`, `bfloat16`, `float16`, `auto` (bf16 on a CPU with AMX/AVX-512-bf16 or CUDA, else fp32)",
        serve=True,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "`auto` (= dtype), `float32`, `bfloat16`, `float16`, `int8` (each token's K and V row per kv head as int8 "
        "with an fp32 scale: ~1.9x the tokens for the same `--kv-cache-memory`; docs/quantization.md)",
        serve=True,
    )
    quantization: str = setting(
        "auto",
        "the linear layers' weights (docs/quantization.md): `none` (`--dtype`; a GGUF file dequantized at load), "
        "`int8` (one scale per output channel, quantized at load from any checkpoint), `gguf` (a GGUF file's "
        "Q8_0 / Q4_0 / Q4_1 blocks as stored; with `--model default`, the default model's Q4_1 file), `q8_0`, "
        "`q4_0` (those GGUF blocks: kept as stored, or quantized at load); `auto`: `gguf` for a `.gguf` file, "
        "else `none`",
        serve=True,
    )
    quantized_activations: str = setting(
        "auto",
        "activations of the quantized kernels: `int8` (dynamic: per row and 64 features for int8 weights, per 32 "
        "for GGUF blocks), `bf16` (weight-only), `auto` (int8 in steps of up to 128 rows for int8 weights and 16 "
        "for GGUF blocks where the C++ kernels run, bf16 in larger ones and on CUDA)",
        serve=True,
    )
    kv_cache_memory: int | None = setting(
        None, "bytes for the KV cache", serve=True, doc_default="`1GiB` on CPU", parse=parse_size
    )
    kv_cache_memory_fraction: float = setting(
        0.85, "on CUDA when `--kv-cache-memory` is not given: fraction of free device memory after weights"
    )
    block_size: int = setting(
        0,
        "tokens per KV block; auto: 16 on CUDA, on the CPU one 4 KiB page of K per kv head (SmolLM2: 16 in fp32, "
        "32 in bf16, 64 in int8)",
        serve=True,
        doc_default="`0` (auto)",
    )
    kv_offload_dir: str = setting(
        "",
        "KV offload tier on disk (docs/kv-offload.md): full KV blocks kept in this directory across restarts; one "
        "live process per directory (a held one fails the start, naming it and its holder's pid)",
        doc_default="none (no disk tier)",
    )
    kv_offload_size: int = setting(
        10 * 2**30,
        "capacity of the disk tier; least recently used blocks are deleted beyond it",
        parse=parse_size,
    )
    kv_offload_memory: int = setting(
        0,
        "host-memory tier in front of the disk (pinned on CUDA); also works alone, without a directory",
        doc_default="`0` (none)",
        parse=parse_size,
    )
    kv_offload_queue: int = setting(
        256 * 2**20,
        "blocks waiting to be written, at most; more are dropped and counted (a step never waits)",
        parse=parse_size,
    )
    kv_offload_dir_next_free: bool = setting(
        False,
        "when `--kv-offload-dir` is held by another live process, take the first free `DIR.1`, `DIR.2`, ... (what "
        "`pagoda serve` does for its default directories)",
    )
    max_model_len: int | None = setting(None, "cap on context length", serve=True, doc_default="model's")
    draft_model: str = setting(
        "",
        "a smaller model proposing speculative tokens for the scheduler's `--speculative draft` "
        "(docs/speculative-decoding.md): a checkpoint folder, a `.gguf` file or `default`, with the model's "
        "tokenizer (another vocabulary is refused at start); its KV cache takes its share of `--kv-cache-memory` "
        "(the same blocks hold both)",
        serve=True,
    )
    device: str = setting("auto", "`cpu`, `cuda`, `cuda:N`, `auto`", serve=True)
    attention_backend: str = setting(
        "auto",
        "`auto`, `cpp`, `torch`, `triton`; auto: Triton on CUDA (with the triton package), the C++ kernels on a CPU "
        "where they are built, else torch",
        serve=True,
    )
    layer_ops: str = setting(
        "auto",
        "`auto`, `cpp`, `torch`: the linear layers and elementwise ops; auto: the C++ ops on a CPU where they are "
        "built, else torch",
        serve=True,
    )
    batch_invariant: bool = setting(
        False,
        "every token the same bits as the same request alone, whatever else is in the step: chunk size, batch, "
        "prefix-cache hits, preemption, speculation (docs/durability.md); the C++ kernels on a CPU, Triton on CUDA",
        serve=True,
    )
    lora: tuple[str, ...] = lora_setting(
        "a LoRA adapter to register at start, `NAME=PATH` (a PEFT folder: `adapter_config.json`, "
        "`adapter_model.safetensors`); repeat the flag for more (docs/lora.md)",
        serve=True,
    )
    max_loras: int = setting(4, "LoRA adapters resident on the device at once", serve=True)
    max_lora_rank: int = setting(64, "the largest LoRA rank accepted", serve=True)
    max_cpu_loras: int | None = setting(
        None,
        "checked LoRA adapters kept in host memory (an LRU; others are read from their folder again when needed)",
        serve=True,
        doc_default="all registered",
    )
    num_threads: int | None = setting(None, "intra-op threads", serve=True, doc_default="torch default")
    tensor_parallel_size: int = setting(
        1,
        "ranks that split every layer (heads, MLP, experts, vocabulary) of one executor group (docs/parallel.md)",
        serve=True,
    )
    pipeline_parallel_size: int = setting(
        1, "stages that split the layers of one executor group (docs/parallel.md)", serve=True
    )
    group_rank: int = setting(
        0, "the first group rank this process runs; rank 0, the leader, alone serves the Executor API"
    )
    group_local_ranks: int = setting(
        0,
        "group ranks this process runs: itself and the next ones as child processes",
        doc_default="`0`: the whole group for rank 0, else 1",
    )
    group_address: str = setting(
        "",
        "HOST:PORT where the group's ranks meet (the leader's; needed when ranks run in other pods or hosts)",
        doc_default="127.0.0.1 and a free port (outside the ephemeral range) when every rank is local",
    )
    group_timeout_s: float = setting(
        60.0, "a collective, or the leader's silence, longer than this takes the executor group down"
    )
    group_start_timeout_s: float = setting(
        300.0, "how long the ranks of an executor group wait for each other to meet (a restarting peer included)"
    )
    max_message_bytes: int = setting(64 * 2**20, "largest plan message accepted", parse=parse_size)
    metrics_port: int = setting(0, "Prometheus `/metrics` port", doc_default="`0` (off)")
    log_format: str = log_format_setting()
    otlp_endpoint: str = otlp_endpoint_setting()
    drain_timeout_s: float = setting(30.0, "on SIGTERM, time to finish work before exiting")
    tls_cert: str = setting("", "serve TLS with this certificate (PEM), with `--tls-key`")
    tls_key: str = setting("", "the private key of `--tls-cert` (PEM)")
    tls_ca: str = setting("", "require client certificates signed by this CA (mTLS; PEM)")
    simulate: bool = setting(
        False,
        "serve a simulated model instead (no weights, no torch imported): each step sleeps the time a cost model "
        "fitted to SmolLM2-135M bf16 steps on this CPU gives it, and tokens are a hash of (seed, position, the four "
        "previous tokens), never a special token; `--model`, `--dtype` and the KV-cache memory flags are ignored, "
        "and `--max-model-len` defaults to 8192 (docs/durability.md, section 5)",
    )
    simulate_kv_blocks: int = setting(
        4096, "with `--simulate`: KV blocks the executor reports (`--block-size` tokens each, 16 when auto)"
    )
    simulate_vocab_size: int = setting(
        512, "with `--simulate`: size of the in-memory tokenizer's vocabulary (53 to 4953)"
    )
    simulate_tokenizer: str = setting(
        "word-level",
        "with `--simulate`: `word-level` (a WordPiece decoder, detokenized by windows as SentencePiece models are) "
        "or `byte-level` (the same words as GPT-2 ByteLevel tokens, detokenized by token bytes as SmolLM2, Llama 3 "
        "and Qwen are)",
    )
    simulate_time_scale: float = setting(
        1.0, "with `--simulate`: multiplies the modelled step time (`0`: no sleep; `0.1`: an executor 10x faster)"
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
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be positive")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 0:
            raise ValueError("--max-cpu-loras must not be negative")
        lora_specs(self.lora)
        if self.simulate and self.lora:
            raise ValueError("--lora needs a model: a simulated executor (--simulate) serves no LoRA adapters")
        if self.simulate_time_scale < 0:
            raise ValueError("--simulate-time-scale must not be negative")
        if self.simulate and self.draft_model:
            raise ValueError("--draft-model needs a model: a simulated executor (--simulate) has no draft model")
        self._check_group()
        if self.simulate:
            from executor_svc.simulate.tokenizer import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, TOKENIZER_KINDS

            if not MIN_VOCAB_SIZE <= self.simulate_vocab_size <= MAX_VOCAB_SIZE:
                raise ValueError(f"--simulate-vocab-size must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]")
            if self.simulate_tokenizer not in TOKENIZER_KINDS:
                raise ValueError(f"--simulate-tokenizer must be one of {', '.join(TOKENIZER_KINDS)}")

    @property
    def group_size(self) -> int:
        """Ranks of the executor group (1: a plain executor)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_ranks(self) -> int:
        """Ranks this process runs (itself first)."""
        return self.group_local_ranks or (self.group_size if self.group_rank == 0 else 1)

    def _check_group(self) -> None:
        """The group flags are consistent and name nothing a group does not serve yet."""
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("--tensor-parallel-size and --pipeline-parallel-size must be positive")
        if not 0 <= self.group_rank < self.group_size:
            raise ValueError(f"--group-rank must be in [0, {self.group_size}) for a group of {self.group_size}")
        if self.group_local_ranks < 0 or self.group_rank + self.local_ranks > self.group_size:
            raise ValueError(
                f"--group-local-ranks {self.local_ranks} from rank {self.group_rank} runs past the group's "
                f"{self.group_size} ranks"
            )
        if self.group_timeout_s <= 0 or self.group_start_timeout_s <= 0:
            raise ValueError("--group-timeout-s and --group-start-timeout-s must be positive")
        if self.group_size == 1:
            return
        if self.local_ranks < self.group_size and not self.group_address:
            raise ValueError("--group-address is needed when ranks of the group run in other processes (pods, hosts)")
        unserved = {
            "--simulate": self.simulate,
            "--lora": bool(self.lora),
            "--kv-offload-dir": bool(self.kv_offload_dir),
            "--batch-invariant": self.batch_invariant,
        }
        named = [flag for flag, given in unserved.items() if given]
        if named:
            raise ValueError(
                f"{', '.join(named)}: not served by an executor group yet (--tensor-parallel-size / "
                "--pipeline-parallel-size above 1; docs/parallel.md)"
            )


def load_config(argv: Sequence[str] | None = None) -> ExecutorConfig:
    """Parse flags and environment into an ExecutorConfig."""
    return parse_config(ExecutorConfig, argv, "pagoda-executor", "Pagoda executor: model, KV cache, paged attention.")
