"""The server's status types (``Client.status()``), one frozen dataclass per proto message.

Generated from protos/pagoda/v1/generation.proto by ``make proto`` (``python -m scripts.gen_client_status``);
do not edit: a field is documented by its comment in the .proto. The client converts a
message by field name (``pagoda_client.core.convert.message_from_pb``).
``tests/client/test_status_types.py`` checks that this file is current.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GroupRankStatus:
    """One rank of an executor group (ExecutorInfo.group_ranks)."""

    rank: int = 0
    """Its rank in the group; rank 0 is the leader, the executor the scheduler talks to."""
    host: str = ""
    """The host it runs on."""
    pid: int = 0
    """Its process id there."""
    shard: str = ""
    """What it holds, e.g. "layers 0-1, q heads 0-1, kv heads 0-0, vocab 0-191"."""
    rss_bytes: int = 0
    """Its resident memory when the group formed."""
    kv_cache_bytes: int = 0
    """Its KV cache."""
    health: str = ""
    """Its health: ok (its leader answers, and a lost rank ends the group at once), or unknown (the leader did not
    answer the last heartbeat)."""


@dataclass(frozen=True)
class ExecutorStatus:
    """One executor as the scheduler sees it."""

    address: str = ""
    """Its address, host:port."""
    incarnation_id: str = ""
    """The executor process's id, new at each restart (empty until described)."""
    state: str = ""
    """READY or DRAINING: this scheduler holds it; HELD_BY_OTHER: another scheduler does (lease_holder); FREE: nobody
    does; CONNECTING: being described or acquired; DEAD: unreachable."""
    num_running: int = 0
    """Sequences this scheduler runs on it (0 unless this scheduler drives it)."""
    num_waiting: int = 0
    """Sequences waiting in this scheduler's queue for it."""
    num_kv_blocks: int = 0
    """Its KV cache blocks (0 unless this scheduler drives it)."""
    num_free_kv_blocks: int = 0
    """Of those, the free ones."""
    kv_cache_usage: float = 0.0
    """Fraction of KV blocks in use, 0..1."""
    kernels: dict[str, str] = field(default_factory=dict)
    """The code path each part of a step runs on it, e.g. {"attention": "cpp", "gemm": "amx-panel"} (as
    ExecutorInfo.kernels)."""
    lease_holder: str = ""
    """The scheduler driving it (this one when state is READY or DRAINING; empty: none)."""
    lease_epoch: int = 0
    """The epoch of that scheduler's lease."""
    kv_offload: str = ""
    """Its KV offload tier, e.g. "disk 10.00 GiB at /path" (empty: none)."""
    num_tier_blocks: int = 0
    """Blocks its offload tier holds, as this scheduler knows."""
    kv_cache_dtype: str = ""
    """Its KV cache dtype (as ModelInfo.kv_cache_dtype); empty until described."""
    quantization: str = ""
    """Its weights' quantization (as ModelInfo.quantization); empty until described."""
    draft_model: str = ""
    """The draft model proposing speculative tokens on it (empty: none; ExecutorInfo.draft_model)."""
    batch_invariant: bool = False
    """It serves batch-invariant (as ExecutorInfo.batch_invariant)."""
    loras: tuple[str, ...] = ()
    """The LoRA adapters registered on it, by name (ExecutorInfo.loras)."""
    tensor_parallel_size: int = 0
    """Its executor group's ranks that split each layer (docs/parallel.md); 1 for a plain executor, 0 until
    described."""
    pipeline_parallel_size: int = 0
    """Its executor group's stages that split the layers; 1 for a plain executor, 0 until described."""
    group_ranks: tuple[GroupRankStatus, ...] = ()
    """Its group's ranks as the leader's last heartbeat reported them (empty for a plain executor)."""
    group_last_contact_s: float = 0.0
    """Seconds since its group last completed a call with every rank (a step or the leader's ping), at its last
    heartbeat; 0 for a plain executor."""


@dataclass(frozen=True)
class ServerStatus:
    """Queues, KV usage and executors of the scheduler."""

    num_running: int = 0
    """Sequences running, over the executors this scheduler drives."""
    num_waiting: int = 0
    """Requests waiting: queued for an executor, or without one yet."""
    kv_cache_usage: float = 0.0
    """Fraction of the KV blocks in use, over the executors this scheduler drives."""
    executors: tuple[ExecutorStatus, ...] = ()
    """Every executor this scheduler knows, held or only seen."""
    num_requests_total: int = 0
    """Requests finished since the scheduler started, whatever the reason."""
    num_preemptions_total: int = 0
    """Preemptions: a running sequence's blocks freed for others, to be recomputed or loaded back from an offload tier
    later."""
    prefix_cache_queries_total: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits_total: int = 0
    """Of those, the tokens found there."""
    scheduler_id: str = ""
    """This scheduler's id in the executors' leases."""
    schedulers: tuple[str, ...] = ()
    """Every live scheduler the executors report (sorted)."""
    spec_num_drafts_total: int = 0
    """Speculative decoding (docs/speculative-decoding.md): sequence-steps that verified draft tokens."""
    spec_draft_tokens_total: int = 0
    """Draft tokens proposed."""
    spec_accepted_tokens_total: int = 0
    """Draft tokens accepted."""
    offload_hit_tokens_total: int = 0
    """Prompt tokens loaded from the executors' KV offload tiers instead of computed."""
    num_swaps_total: int = 0
    """Preempted sequences resumed by loading their blocks from an offload tier (swaps)."""
    spec_model_num_drafts_total: int = 0
    """Of the sequence-steps with drafts, those whose drafts the executors' draft models proposed (the rest are n-gram
    drafts)."""
    spec_model_draft_tokens_total: int = 0
    """Draft tokens the draft models proposed."""
    spec_model_accepted_tokens_total: int = 0
    """Draft-model tokens accepted."""
